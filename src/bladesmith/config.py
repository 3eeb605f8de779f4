"""Config: the settings of ``optimize``, as an argument or as a context manager.

    with bladesmith.Config(exclude=["channels_last"], iters=50):
        optimized, spec, report = bladesmith.optimize(model, test_data=data)

``optimize(config=...)`` wins over the innermost ``with Config(...)``, which wins over the
defaults. PAI-Blade's assignments work too, each value checked as it is set:

    blade_config = bladesmith.Config()
    blade_config.gpu_config.disable_fp16_accuracy_check = True
    with blade_config:
        ...
 Levels: o0 changes no numerical precision; o1 adds fp16/bf16, kept only when
the outputs stay within tolerance; o2 adds what takes longer to build (Inductor's
max-autotune, Inductor on the CPU).
"""

from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass, field

LEVELS = ("o0", "o1", "o2")
OUTPUT_FORMS = ("native", "padded")
OPENVINO_HINTS = ("latency", "throughput")  # OpenVINO's PERFORMANCE_HINT, in lower case

_current: contextvars.ContextVar[Config | None] = contextvars.ContextVar(
    "bladesmith_config", default=None
)


@dataclass
class Config:
    """What ``optimize`` tries and how it decides.

    Accuracy: ``rtol``/``atol`` override the per-dtype tolerances of
    ``bladesmith.verify.default_tolerance`` for tensor outputs; detections match when
    F1 >= ``min_f1`` at IoU >= ``iou_threshold``, same class.
    ``disable_fp16_accuracy_check`` keeps fp16/bf16 even when it moves the outputs past
    tolerance (the report still shows by how much; a result whose outputs ignore its
    inputs is refused all the same); PAI-Blade sets it as
    ``config.gpu_config.disable_fp16_accuracy_check``.
    Timing: ``warmup``/``iters`` default per device (None: CUDA 20/100, CPU 3/10), for
    each side of a comparison: a candidate and the best so far run in ``rounds``
    alternating rounds (default 10, at most ``iters``); a pass is kept only when the
    interval of its speedup lies above ``min_speedup``
    (``bladesmith.bench.STATISTIC`` says how both are computed).
    Passes: ``include`` adds passes that the level leaves out, ``exclude`` removes
    passes; both by name (see ``bladesmith.passes.registry.names()``).
    ``output="padded"`` makes the optimized module of a model that a family adapts
    (``bladesmith.families``: a detector) take one batch tensor [B, 3, H, W] and return
    the family's padded tensors (a detector's boxes, scores, labels, num_detections),
    instead of the model's own structure.
    ``allow_degenerate``: keep passes even when the comparison has nothing to compare
    (non-finite inputs or reference outputs, no outputs, all-zero outputs, no detections),
    which is otherwise diagnosed and keeps nothing.
    ``progress``: a spinner on a terminal, else a line per pass (None or True); False: quiet.
    ``save_as``: the save format the result is for (a suffix of
    ``runtimes.formats.FORMATS``, checked by ``optimize``; ``optimize --out`` sets it):
    passes whose result cannot be saved in it are skipped.
    ``openvino_hint`` ("latency" or "throughput"), ``openvino_threads`` and
    ``openvino_streams`` (None: OpenVINO's choice): how the openvino pass compiles the
    model for the CPU, as it will be deployed; recorded in a ``.ov`` and applied on load.
    """

    rtol: float | None = None
    atol: float | None = None
    iou_threshold: float = 0.9
    min_f1: float = 0.99
    disable_fp16_accuracy_check: bool = False
    warmup: int | None = None
    iters: int | None = None
    rounds: int | None = None
    min_speedup: float = 1.03
    include: tuple[str, ...] = field(default_factory=tuple)
    exclude: tuple[str, ...] = field(default_factory=tuple)
    output: str = "native"
    allow_degenerate: bool = False
    progress: bool | None = None
    save_as: str | None = None
    openvino_hint: str = "latency"
    openvino_threads: int | None = None
    openvino_streams: int | None = None

    def __post_init__(self):
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        self._check()
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name: str, value) -> None:
        """A setting assigned (PAI-Blade's style) is checked as ``Config(...)`` checks it;
        a name that is no setting is refused, not silently kept."""
        if not self.__dict__.get("_ready"):  # the dataclass's own __init__
            object.__setattr__(self, name, value)
            return
        if name not in _FIELDS:
            raise AttributeError(
                f"Config has no setting {name!r}; settings are {', '.join(_FIELDS)}"
            )
        checked = dataclasses.replace(self, **{name: value})  # raises on a bad value
        object.__setattr__(self, name, getattr(checked, name))

    @property
    def gpu_config(self) -> _Section:
        """PAI-Blade's ``config.gpu_config``: its ``disable_fp16_accuracy_check`` is this
        Config's (the fp16/bf16 check on any device)."""
        return _Section(self, "gpu_config", ("disable_fp16_accuracy_check",))

    def _check(self) -> None:
        overlap = set(self.include) & set(self.exclude)
        if overlap:
            raise ValueError(f"Config: passes both included and excluded: {sorted(overlap)}")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"Config.{name} must be >= 0, got {value!r}")
        if not 0 < self.iou_threshold <= 1:
            raise ValueError(f"Config.iou_threshold must be in (0, 1], got {self.iou_threshold!r}")
        if not 0 <= self.min_f1 <= 1:
            raise ValueError(f"Config.min_f1 must be in [0, 1], got {self.min_f1!r}")
        if self.warmup is not None and (not isinstance(self.warmup, int) or self.warmup < 0):
            raise ValueError(f"Config.warmup must be an integer >= 0, got {self.warmup!r}")
        if self.iters is not None and (not isinstance(self.iters, int) or self.iters < 1):
            raise ValueError(f"Config.iters must be an integer >= 1, got {self.iters!r}")
        if self.rounds is not None and (not isinstance(self.rounds, int) or self.rounds < 1):
            raise ValueError(f"Config.rounds must be an integer >= 1, got {self.rounds!r}")
        if self.min_speedup <= 0:
            raise ValueError(f"Config.min_speedup must be > 0, got {self.min_speedup!r}")
        if self.openvino_hint not in OPENVINO_HINTS:
            raise ValueError(
                f"Config.openvino_hint must be one of {', '.join(OPENVINO_HINTS)}, "
                f"got {self.openvino_hint!r}"
            )
        for name in ("openvino_threads", "openvino_streams"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Config.{name} must be an integer >= 1, got {value!r}")
        if self.output not in OUTPUT_FORMS:
            raise ValueError(
                f"Config.output must be one of {', '.join(OUTPUT_FORMS)}, got {self.output!r}"
            )

    def __enter__(self) -> Config:
        # A stack of tokens, so that one Config may be entered again while active;
        # object.__setattr__ because the dataclass is frozen (this is bookkeeping).
        object.__setattr__(self, "_tokens", [*getattr(self, "_tokens", []), _current.set(self)])
        return self

    def __exit__(self, *exc_info) -> None:
        _current.reset(self._tokens.pop())

    @classmethod
    def current(cls) -> Config:
        """The innermost ``with Config(...)``'s settings, or the defaults."""
        return _current.get() or cls()

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def timing_counts(self, device_type: str) -> tuple[int, int]:
        """(warm-up, timed iterations) for a device: enough to be stable on a GPU, few
        enough that a 2-core CPU finishes a detector in minutes."""
        warmup, iters = (20, 100) if device_type == "cuda" else (3, 10)
        return (
            self.warmup if self.warmup is not None else warmup,
            self.iters if self.iters is not None else iters,
        )

    def timing_rounds(self, iters: int) -> int:
        """Rounds a comparison alternates over: ``rounds``, else 10; at most ``iters``."""
        from bladesmith.bench import DEFAULT_ROUNDS

        return min(self.rounds if self.rounds is not None else DEFAULT_ROUNDS, iters)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_FIELDS = tuple(f.name for f in dataclasses.fields(Config))


class _Section:
    """A group of a Config's settings under PAI-Blade's name for it (``gpu_config``):
    reading and assigning them reads and assigns the Config's."""

    def __init__(self, config: Config, title: str, names: tuple[str, ...]):
        object.__setattr__(self, "_where", (config, title, names))

    def __getattr__(self, name: str):
        config, _, _ = self._where
        return getattr(config, self._known(name))

    def __setattr__(self, name: str, value) -> None:
        config, _, _ = self._where
        setattr(config, self._known(name), value)

    def _known(self, name: str) -> str:
        _, title, names = self._where
        if name not in names:
            raise AttributeError(
                f"Config.{title} has no setting {name!r}; bladesmith takes {', '.join(names)} "
                "there (the others of Config are set on it directly)"
            )
        return name


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    return level
