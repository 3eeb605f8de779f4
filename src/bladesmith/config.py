"""Config: the settings of ``optimize``, as an argument or as a context manager.

    with bladesmith.Config(exclude=["channels_last"], iters=50):
        optimized, spec, report = bladesmith.optimize(model, test_data=data)

``optimize(config=...)`` wins over the innermost ``with Config(...)``, which wins over the
defaults. PAI-Blade's assignments work too, each value checked as it is set:

    blade_config = bladesmith.Config()
    blade_config.gpu_config.disable_fp16_accuracy_check = True
    with blade_config:
        ...

Every setting is one row of ``SETTINGS`` (its kind, range or choices, and what it does):
the constructor, every assignment and the command line's flags check a value against
it, and a bad one is one ``SettingError`` line naming the setting and what it takes.
Levels: o0 changes no numerical precision; o1 adds fp16/bf16, kept only when the outputs
stay within tolerance; o2 adds what takes longer to build (Inductor's max-autotune,
Inductor on the CPU) and int8 quantization, judged by the task's metric.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field

from bladesmith.errors import SettingError

LEVELS = ("o0", "o1", "o2")
OUTPUT_FORMS = ("native", "padded")
OPENVINO_HINTS = ("latency", "throughput")  # OpenVINO's PERFORMANCE_HINT, in lower case

_current: contextvars.ContextVar[Config | None] = contextvars.ContextVar(
    "bladesmith_config", default=None
)


@dataclass(frozen=True)
class Setting:
    """One setting: its ``kind`` ("bool", "int", "number", "choice", "names", a pass
    name or several, or "suffix", a format's), whether None is allowed (``optional``:
    None then means the default ``doc`` gives), its range (``low``/``high``, ``low``
    excluded when ``above``) or its ``choices``, and what it does (``doc``, as
    docs/optimize.md lists it)."""

    name: str
    kind: str
    doc: str
    optional: bool = False
    low: float | None = None
    high: float | None = None
    above: bool = False
    choices: tuple = ()

    @property
    def expected(self) -> str:
        """What the setting takes, in words ("a number in (0, 1]")."""
        return self._takes() + (" or None" if self.optional else "")

    def _takes(self) -> str:
        if self.kind == "choice":
            text = "one of " + ", ".join(repr(choice) for choice in self.choices)
        elif self.kind == "names":
            text = "a pass name or a list of pass names"
        elif self.kind == "suffix":
            text = "a file suffix such as '.pt'"
        elif self.kind == "callable":
            text = "a function"
        elif self.kind == "data":
            text = "a non-empty list of inputs, as test_data takes them"
        else:
            text = {"bool": "True or False", "int": "an integer", "number": "a number"}[self.kind]
            if self.low is not None and self.high is not None:
                text += f" in {'(' if self.above else '['}{self.low:g}, {self.high:g}]"
            elif self.low is not None:
                text += f" {'>' if self.above else '>='} {self.low:g}"
        return text

    def check(self, value):
        """``value`` as the setting holds it (a number as float, names as a tuple), or a
        ``SettingError`` naming the setting and what it takes."""
        if value is None and self.optional:
            return None
        checked = self._checked(value)
        if checked is _BAD:
            plain = value is None or isinstance(value, (int, float))
            shown = f"{value!r}" + ("" if plain else " " + _type(value))
            raise SettingError(f"Config.{self.name}: expected {self.expected}, got {shown}")
        return checked

    def _in_range(self, value) -> bool:
        if self.kind not in ("int", "number"):
            return True
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or value <= self.high

    def parse(self, text: str):
        """The setting from a command-line flag's ``text``: an integer or number read
        from it, then checked (argparse turns the error into its one line)."""
        import argparse

        reader = {"int": int, "number": float}.get(self.kind, str)
        try:
            value = reader(text)
        except ValueError:
            value = _BAD
        if value is _BAD or value is None or self._checked(value) is _BAD:
            raise argparse.ArgumentTypeError(f"expected {self._takes()}, got {text!r}")
        return self._checked(value)

    def _checked(self, value):
        checked = _KINDS[self.kind](self, value)
        return checked if checked is not _BAD and self._in_range(checked) else _BAD


_BAD = object()


def _type(value) -> str:
    return f"(a {type(value).__name__})"


def _bool(setting: Setting, value):
    # Only True and False: "False" and "no" are truthy strings, and 0/1 hide a mistake.
    return value if isinstance(value, bool) else _BAD


def _int(setting: Setting, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return _BAD
    return int(value)


def _number(setting: Setting, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return _BAD
    value = float(value)
    return value if math.isfinite(value) else _BAD


def _choice(setting: Setting, value):
    return value if isinstance(value, str) and value in setting.choices else _BAD


def _suffix(setting: Setting, value):
    # Which suffixes exist is runtimes.formats.FORMATS', above this module: optimize
    # checks the name, this the form.
    return value if isinstance(value, str) and len(value) > 1 and value[0] == "." else _BAD


def _callable(setting: Setting, value):
    return value if callable(value) else _BAD


def _data(setting: Setting, value):
    # A non-empty list or tuple of entries, or a batch tensor; what the entries are is
    # checked where they are read, as test_data's are.
    if isinstance(value, (list, tuple)) or type(value).__name__ == "Tensor":
        return value if len(value) else _BAD
    return _BAD


def _names(setting: Setting, value):
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable) or isinstance(value, (bytes, dict)):
        return _BAD
    value = tuple(value)
    return value if all(isinstance(name, str) and name for name in value) else _BAD


_KINDS = {
    "bool": _bool,
    "int": _int,
    "number": _number,
    "choice": _choice,
    "names": _names,
    "suffix": _suffix,
    "callable": _callable,
    "data": _data,
}

SETTINGS = {
    setting.name: setting
    for setting in (
        Setting(
            "rtol",
            "number",
            "relative tolerance of tensor outputs, instead of the dtype's default "
            "(`verify.default_tolerance`)",
            optional=True,
            low=0,
        ),
        Setting(
            "atol",
            "number",
            "absolute tolerance of tensor outputs, instead of the one measured on the "
            "model under rounding noise",
            optional=True,
            low=0,
        ),
        Setting(
            "iou_threshold",
            "number",
            "IoU at which a detection matches its reference (same class)",
            low=0,
            high=1,
            above=True,
        ),
        Setting("min_f1", "number", "F1 that detections must reach", low=0, high=1),
        Setting(
            "disable_fp16_accuracy_check",
            "bool",
            "keep fp16/bf16 even when it moves the outputs past tolerance (the report "
            "still shows how far; a result whose outputs ignore its inputs is refused all "
            "the same); PAI-Blade sets it as `config.gpu_config.disable_fp16_accuracy_check`",
        ),
        Setting(
            "warmup",
            "int",
            "warm-up runs of each side of a comparison (None: CUDA 20, CPU 3)",
            optional=True,
            low=0,
        ),
        Setting(
            "iters",
            "int",
            "timed runs of each side of a comparison (None: CUDA 100, CPU 10)",
            optional=True,
            low=1,
        ),
        Setting(
            "rounds",
            "int",
            "alternating rounds a comparison's runs are split into (None: 10; at most `iters`)",
            optional=True,
            low=1,
        ),
        Setting(
            "min_speedup",
            "number",
            "a pass is kept only when the interval of its speedup lies above it",
            low=0,
            above=True,
        ),
        Setting("include", "names", "passes to try that the level leaves out"),
        Setting("exclude", "names", "passes not to try"),
        Setting(
            "output",
            "choice",
            '"padded": the result of a model a family adapts (a detector) takes one batch '
            "tensor and returns the family's padded tensors instead of the model's own "
            "structure",
            choices=OUTPUT_FORMS,
        ),
        Setting(
            "allow_degenerate",
            "bool",
            "keep passes even when the comparison has nothing to compare (non-finite "
            "inputs or outputs, all-zero outputs, no detections)",
        ),
        Setting(
            "allow_unverified",
            "bool",
            "keep passes that change the arithmetic even where the test inputs cannot "
            "verify them (the model does not reproduce its own answer under rounding "
            'noise); the report says "not verified on these inputs" all the same',
        ),
        Setting(
            "progress",
            "bool",
            "a spinner on a terminal, else a line per pass (None or True); False: quiet",
            optional=True,
        ),
        Setting(
            "save_as",
            "suffix",
            "the save format the result is for, a suffix `bladesmith doctor` lists "
            "(`optimize --out` sets it): passes whose result cannot be saved in it are skipped",
            optional=True,
        ),
        Setting(
            "calibration_data",
            "data",
            "inputs a quantizing pass calibrates on (None: derived from the test data as "
            "held-out inputs are, never the inputs a verdict uses); the report gives their "
            "count and source",
            optional=True,
        ),
        Setting(
            "held_out_data",
            "data",
            "inputs every result is also judged on against the model as given, and a "
            "quantized result's metric counts over (None: derived from the test data, at "
            "least 100 items for the metric); no pass sees them",
            optional=True,
        ),
        Setting(
            "metric",
            "callable",
            "the task metric that judges a quantized result: `metric(outputs, inputs)` -> "
            "a number, higher is better, on the held-out inputs (None: top-1 agreement for "
            "a classifier, detection F1 for a detector, against the model as given)",
            optional=True,
        ),
        Setting(
            "max_drop",
            "number",
            "how far a quantized result's metric may fall below the model as given's (None: "
            "0.01 for top-1 agreement and `metric`, 0.03 for detection F1)",
            optional=True,
            low=0,
        ),
        Setting(
            "openvino_hint",
            "choice",
            "how the `openvino` pass compiles the model (OpenVINO's PERFORMANCE_HINT); a "
            "`.ov` records it and applies it on load",
            choices=OPENVINO_HINTS,
        ),
        Setting(
            "openvino_threads",
            "int",
            "OpenVINO's inference threads (None: OpenVINO's choice); recorded in a `.ov`",
            optional=True,
            low=1,
        ),
        Setting(
            "openvino_streams",
            "int",
            "OpenVINO's streams (None: OpenVINO's choice); recorded in a `.ov`",
            optional=True,
            low=1,
        ),
    )
}


@dataclass
class Config:
    """What ``optimize`` tries and how it decides; ``SETTINGS`` says what each setting
    takes and does.

    Accuracy: ``rtol``/``atol`` override the per-dtype tolerances of
    ``bladesmith.verify.default_tolerance`` for tensor outputs; detections match when
    F1 >= ``min_f1`` at IoU >= ``iou_threshold``, same class.
    Timing: a candidate and the best so far run in ``rounds`` alternating rounds of
    ``iters`` runs in all after ``warmup`` (``bladesmith.bench.STATISTIC`` says how the
    speedup and its interval are computed).
    Passes: ``include`` and ``exclude`` by name (``bladesmith.passes.registry.names()``).
    OpenVINO: ``openvino_hint``, ``openvino_threads`` and ``openvino_streams`` are how
    the openvino pass compiles the model for the CPU, as it will be deployed; a ``.ov``
    records them and applies them on load.
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
    allow_unverified: bool = False
    progress: bool | None = None
    save_as: str | None = None
    calibration_data: object = None
    held_out_data: object = None
    metric: object = None
    max_drop: float | None = None
    openvino_hint: str = "latency"
    openvino_threads: int | None = None
    openvino_streams: int | None = None

    def __new__(cls, *args, **settings):
        unknown = [name for name in settings if name not in SETTINGS]
        if unknown:  # before the dataclass's __init__ says it in a bare TypeError
            raise SettingError(
                f"Config has no setting {unknown[0]!r}; settings are {', '.join(SETTINGS)}"
            )
        return super().__new__(cls)

    def __post_init__(self):
        for name, setting in SETTINGS.items():
            object.__setattr__(self, name, setting.check(getattr(self, name)))
        overlap = set(self.include) & set(self.exclude)
        if overlap:
            raise SettingError(f"Config: passes both included and excluded: {sorted(overlap)}")
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name: str, value) -> None:
        """A setting assigned (PAI-Blade's style) is checked as ``Config(...)`` checks it;
        a name that is no setting is refused, not silently kept."""
        if not self.__dict__.get("_ready"):  # the dataclass's own __init__
            object.__setattr__(self, name, value)
            return
        if name not in SETTINGS:
            raise AttributeError(
                f"Config has no setting {name!r}; settings are {', '.join(SETTINGS)}"
            )
        checked = dataclasses.replace(self, **{name: value})  # raises on a bad value
        object.__setattr__(self, name, getattr(checked, name))

    @property
    def gpu_config(self) -> _Section:
        """PAI-Blade's ``config.gpu_config``: its ``disable_fp16_accuracy_check`` is this
        Config's (the fp16/bf16 check on any device)."""
        return _Section(self, "gpu_config", ("disable_fp16_accuracy_check",))

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
        return {name: getattr(self, name) for name in SETTINGS}


_FIELDS = tuple(f.name for f in dataclasses.fields(Config))
if _FIELDS != tuple(SETTINGS):  # a field without its row would go unchecked
    raise AssertionError(f"Config's fields {_FIELDS} and SETTINGS {tuple(SETTINGS)} differ")


def check_config(config) -> Config:
    """``config`` when it is a ``Config``, else one line saying what is expected."""
    if not isinstance(config, Config):
        raise SettingError(
            f"config: expected a bladesmith.Config, got {config!r} {_type(config)}; "
            "bladesmith.Config(rtol=..., ...) makes one"
        )
    return config


def settings_table() -> str:
    """The settings as docs/optimize.md lists them: a Markdown table of each setting,
    its default, what it takes and what it does."""
    defaults = {name: getattr(Config(), name) for name in SETTINGS}
    rows = [
        "| setting | default | takes | what it does |",
        "| --- | --- | --- | --- |",
        *(
            f"| `{s.name}` | `{defaults[s.name]!r}` | {s.expected} | {s.doc} |"
            for s in SETTINGS.values()
        ),
    ]
    return "\n".join(rows)


class _Section:
    """A group of a Config's settings under PAI-Blade's name for it (``gpu_config``):
    reading and assigning them reads and assigns the Config's."""

    def __init__(self, config: Config, title: str, names: tuple[str, ...]):
        object.__setattr__(self, "_where", (config, title, names))

    def __getattr__(self, name: str):
        config, _, _ = self._where
        return getattr(config, self._known(name))

    def __setattr__(self, name: str, value) -> None:
        config, title, _ = self._where
        name = self._known(name)
        try:
            setattr(config, name, value)
        except SettingError as error:  # named as the user wrote it
            raise SettingError(
                str(error).replace(f"Config.{name}", f"Config.{title}.{name}", 1)
            ) from None

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
        raise SettingError(f"level: expected one of {', '.join(LEVELS)}, got {level!r}")
    return level
