"""ONNX Runtime sessions with the execution providers and options a device needs.

``plan_providers`` is a pure function (the providers this onnxruntime offers in, the
providers with their options and the session settings out), so every device's choice
is testable without its hardware. ``session`` applies a plan, registers the bladesmith
operators for models exported with ``custom_ops="domain"``, and returns a ``Session``
that reports the providers ONNX Runtime actually used.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bladesmith.errors import BladesmithError, DeviceUnavailableError

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
DIRECTML = "DmlExecutionProvider"
DEVICES = ("auto", "cpu", "cuda", "tensorrt", "dml")

# What to install when a device's provider is missing from this onnxruntime.
_INSTALL = {
    CUDA: "install onnxruntime-gpu (in place of onnxruntime) with a CUDA-capable driver",
    TENSORRT: "install onnxruntime-gpu and TensorRT (pip install tensorrt)",
    DIRECTML: "install onnxruntime-directml (Windows) in place of onnxruntime",
}
_DEVICE_NAME = re.compile(r"(?P<kind>[a-z]+)(?::(?P<index>\d+))?")


@dataclass(frozen=True)
class ProviderPlan:
    """Providers in priority order, each with its options, plus the session settings
    the first provider needs (``SessionOptions`` attribute -> value)."""

    providers: list[tuple[str, dict]]
    session_settings: dict = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.providers]


def plan_providers(
    device: str,
    available: Sequence[str],
    *,
    fp16: bool = False,
    trt_cache_dir: str | os.PathLike | None = None,
) -> ProviderPlan:
    """The providers for ``device`` ("auto", "cpu", "cuda[:N]", "tensorrt[:N]", "dml[:N]"),
    given the ``available`` provider names of this onnxruntime.

    Fallbacks: TensorRT, then CUDA, then CPU; DirectML, then CPU; the CPU always last,
    so that nodes a device cannot run (and the Python operators) still run. "auto"
    picks CUDA, then DirectML, then the CPU; TensorRT is never picked implicitly, since
    its first session builds an engine for minutes. ``fp16`` lets TensorRT build fp16
    kernels; ``trt_cache_dir`` (default: ``default_trt_cache_dir()``) holds its engine
    and timing caches.
    """
    kind, index = _parse_device(device)
    available = list(available)
    if kind == "auto":
        kind = next((k for k, p in (("cuda", CUDA), ("dml", DIRECTML)) if p in available), "cpu")
    device_id = {"device_id": index or 0}
    cpu = (CPU, {})
    if kind == "cpu":
        return ProviderPlan([cpu])
    if kind == "cuda":
        _require(CUDA, device, available)
        return ProviderPlan([(CUDA, device_id), cpu])
    if kind == "dml":
        _require(DIRECTML, device, available)
        # DirectML supports neither memory patterns nor parallel execution.
        return ProviderPlan(
            [(DIRECTML, device_id), cpu],
            {"enable_mem_pattern": False, "execution_mode": "ORT_SEQUENTIAL"},
        )
    _require(TENSORRT, device, available)
    cache = str(trt_cache_dir if trt_cache_dir is not None else default_trt_cache_dir())
    tensorrt = {
        **device_id,
        "trt_fp16_enable": fp16,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": cache,
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": cache,
    }
    providers = [(TENSORRT, tensorrt)]
    if CUDA in available:  # TensorRT's fallback for the nodes it does not take
        providers.append((CUDA, device_id))
    return ProviderPlan([*providers, cpu])


def _parse_device(device: str) -> tuple[str, int | None]:
    match = _DEVICE_NAME.fullmatch(str(device).strip().lower())
    if (
        not match
        or match["kind"] not in DEVICES
        or (match["index"] is not None and match["kind"] in ("auto", "cpu"))
    ):
        raise BladesmithError(
            f"device: expected 'auto', 'cpu', 'cuda[:N]', 'tensorrt[:N]' or 'dml[:N]', "
            f"got {device!r}"
        )
    index = match["index"]
    return match["kind"], None if index is None else int(index)


def _require(provider: str, device: str, available: list[str]) -> None:
    if provider not in available:
        raise DeviceUnavailableError(
            f"device {device!r} needs ONNX Runtime's {provider}, which this onnxruntime does "
            f"not have (it has {', '.join(available) or 'none'}): {_INSTALL[provider]}, or "
            "use device='cpu'"
        )


def default_trt_cache_dir() -> Path:
    base = os.environ.get("BLADESMITH_CACHE") or Path.home() / ".cache" / "bladesmith"
    return Path(base) / "tensorrt"


class Session:
    """An ONNX Runtime session that takes numpy arrays or torch tensors.

    ``run(*inputs, **named)`` takes the inputs in the model's order or by name
    (``run(x)``, ``run(images=x)``) and returns every output as a numpy array, in order.
    ONNX Runtime's own form works as on an InferenceSession: ``run(output_names,
    input_feed[, run_options])`` (``run(None, {"images": x})``) returns the outputs named,
    every one for None. Calling the session returns torch tensors, as the module it was
    exported from would (on the CPU). ``providers`` lists the providers ONNX Runtime
    actually kept, best first. Inputs are checked against the shapes and dtypes the model
    was exported for.
    A model exported with non-tensor arguments (``forward(x, flip: bool)``) holds their
    values as constants (``baked_arguments``): it may also be called with all of the
    module's positional arguments, and refuses values other than those.
    """

    def __init__(self, inference_session, plan: ProviderPlan):
        self.inference_session = inference_session
        self.plan = plan
        self.inputs = inference_session.get_inputs()
        self.input_names = [i.name for i in self.inputs]
        self.output_names = [o.name for o in inference_session.get_outputs()]
        self.baked_arguments = _baked_arguments(inference_session)

    @property
    def providers(self) -> list[str]:
        return self.inference_session.get_providers()

    def run(self, *inputs, **named) -> list:
        if _onnxruntime_form(inputs, named):
            output_names, feeds, *run_options = inputs
            return self._run(feeds, output_names, *run_options)
        if self.baked_arguments and (
            len(inputs) > len(self.input_names) or not all(map(_is_array, inputs))
        ):  # the module's own arguments: check the baked ones, then drop them
            self.check_arguments(inputs)
            inputs = tuple(_arrays(inputs))
        for position, value in enumerate(inputs, start=1):
            if value is None or isinstance(value, Mapping):  # ONNX Runtime's form, garbled
                raise BladesmithError(self._convention(f"{_kind(value)} as argument {position}"))
        if len(inputs) > len(self.input_names):
            raise BladesmithError(
                f"the model takes {len(self.input_names)} inputs ({', '.join(self.input_names)})"
                f"; got {len(inputs)}"
            )
        return self._run({**dict(zip(self.input_names, inputs)), **named})

    def _run(self, feeds: Mapping, output_names=None, run_options=None) -> list:
        unknown = set(feeds) - set(self.input_names)
        if unknown:
            raise BladesmithError(
                f"unknown input names {sorted(unknown)}; the model's inputs are "
                f"{', '.join(self.input_names)}"
            )
        missing = [name for name in self.input_names if name not in feeds]
        if missing:
            raise BladesmithError(f"missing inputs: {', '.join(missing)}")
        unknown = set(output_names or ()) - set(self.output_names)
        if unknown:
            raise BladesmithError(
                f"unknown output names {sorted(unknown)}; the model's outputs are "
                f"{', '.join(self.output_names)}"
            )
        arrays = {name: _to_numpy(value) for name, value in feeds.items()}
        for expected in self.inputs:
            _check_input(expected, arrays[expected.name])
        return self.inference_session.run(output_names, arrays, run_options)

    def _convention(self, got: str) -> str:
        first = self.input_names[0] if self.input_names else "x"
        return (
            f"Session.run takes the model's inputs ({', '.join(self.input_names)}) as arrays, "
            "in order or by name (run(x), run(name=x)), or ONNX Runtime's run(output_names, "
            f"{{name: array}}) (run(None, {{'{first}': x}})); got {got}"
        )

    def check_arguments(self, args: tuple, kwargs: dict | None = None) -> None:
        """Refuse, in one line, a call of the exported module whose non-tensor
        arguments differ from those its graph holds as constants."""
        for entry in self.baked_arguments:
            if not holds_argument(entry, args, kwargs):
                name = entry["name"]
                given = given_argument(entry, args, kwargs)
                raise BladesmithError(
                    f"{given}: this ONNX model was exported with {name}={entry['repr']}, "
                    "which its graph holds as a constant (it would answer as if for that "
                    f"value); call it with {name}={entry['repr']}, or export it again with "
                    "the value you need (bladesmith.optimize: test data that passes it)"
                )

    def __call__(self, *inputs, **named):
        import torch

        return tuple(torch.from_numpy(output) for output in self.run(*inputs, **named))

    def __repr__(self) -> str:
        return f"Session(providers={self.providers}, inputs={self.input_names})"


# ONNX Runtime's input types -> numpy dtype names (bfloat16 has none in numpy)
_NUMPY_TYPES = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int16)": "int16",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


def _check_input(expected, array) -> None:
    """One line, before ONNX Runtime's multi-line refusal, when ``array`` is not of the
    shape (its free dimensions aside) and dtype that input ``expected`` was exported for."""
    want_dtype = _NUMPY_TYPES.get(expected.type)
    shape = expected.shape
    fits = len(shape) == array.ndim and all(
        not isinstance(size, int) or size == got for size, got in zip(shape, array.shape)
    )
    if fits and (want_dtype is None or array.dtype.name == want_dtype):
        return
    exported = ", ".join(str(size) if isinstance(size, int) else str(size or "?") for size in shape)
    free = [str(size or "?") for size in shape if not isinstance(size, int)]
    sizes = (
        f"({', '.join(free)} free, the other sizes fixed by the export)"
        if free
        else "(every size fixed by the export)"
    )
    raise BladesmithError(
        f"input {expected.name}: got shape {tuple(array.shape)} {array.dtype.name}, but this "
        f"ONNX model was exported for ({exported}) {want_dtype or expected.type} {sizes}: "
        "pass inputs of that shape and dtype, or export it again with inputs like these "
        "(bladesmith.optimize: test data of this size)"
    )


_METADATA_KEY = "bladesmith.baked_arguments"
_MISSING = object()


def baked_arguments_metadata(entries: list[dict]) -> tuple[str, str]:
    """The metadata entry (key, value) that records ``entries`` in an ONNX file."""
    import json

    return _METADATA_KEY, json.dumps(entries)


def _baked_arguments(inference_session) -> list[dict]:
    import json

    meta = getattr(inference_session, "get_modelmeta", None)
    recorded = meta().custom_metadata_map.get(_METADATA_KEY) if meta else None
    return json.loads(recorded) if recorded else []


def holds_argument(entry: dict, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether a call gives the baked argument ``entry`` (``baked_arguments``) its value."""
    return _same(entry, _argument(entry, args, kwargs or {}))


def given_argument(entry: dict, args: tuple, kwargs: dict | None = None) -> str:
    """What a call gives for the baked argument ``entry``: "name=value" or "not given"."""
    got = _argument(entry, args, kwargs or {})
    return "not given" if got is _MISSING else f"{entry['name']}={_describe(got)}"


def _argument(entry: dict, args: tuple, kwargs: dict):
    """The value a call gives for the baked argument ``entry``, or _MISSING."""
    position, parameter = entry["position"], entry.get("parameter")
    if position < len(args):
        value = args[position]
    elif parameter is not None and parameter in kwargs:
        value = kwargs[parameter]
    else:
        return _MISSING
    if not entry["path"]:
        return value
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_flatten_with_path(value)[0]
    return next((leaf for path, leaf in leaves if pytree.keystr(path) == entry["path"]), _MISSING)


def _same(entry: dict, got) -> bool:
    if got is _MISSING or _is_array(got):
        return False
    if "value" in entry:
        want = entry["value"]
        plain = got is None or isinstance(got, (bool, int, float, str))
        return plain and isinstance(got, bool) == isinstance(want, bool) and got == want
    return _describe(got) == entry["repr"]


def describe_argument(value) -> str:
    """A value as one short line: a tensor by its shape, anything else by its repr."""
    return _describe(value)


def _describe(value) -> str:
    if _is_array(value):
        return f"a tensor of shape {tuple(value.shape)}"
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else f"{text[:77]}..."


def _onnxruntime_form(inputs: tuple, named: dict) -> bool:
    """Whether a call is InferenceSession.run's: (output names or None, {name: value}[,
    run options])."""
    return (
        not named
        and len(inputs) in (2, 3)
        and (inputs[0] is None or _are_names(inputs[0]))
        and isinstance(inputs[1], Mapping)
    )


def _are_names(value) -> bool:
    return (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)
    )


def _kind(value) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _arrays(tree) -> list:
    from torch.utils import _pytree as pytree

    return [leaf for leaf in pytree.tree_leaves(tree) if _is_array(leaf)]


def _to_numpy(value):
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


# Whether sessions made now keep their intra-op threads spinning between runs (ONNX
# Runtime's default, for latency); ``without_spinning`` turns it off.
_SPINNING: contextvars.ContextVar[bool] = contextvars.ContextVar("spinning", default=True)


@contextlib.contextmanager
def without_spinning() -> Iterator[None]:
    """Sessions made inside leave their threads idle between runs
    (``session.intra_op.allow_spinning`` 0): a session timed in alternation with another
    runner must not spin on the cores that runner then uses (eager PyTorch timed beside a
    spinning session ran about 2x slower, and the session's speedup read 2x too high)."""
    token = _SPINNING.set(False)
    try:
        yield
    finally:
        _SPINNING.reset(token)


def session(
    path: str | os.PathLike,
    device: str = "auto",
    *,
    threads: int | None = None,
    fp16: bool = False,
    trt_cache_dir: str | os.PathLike | None = None,
) -> Session:
    """An ONNX Runtime session for the model at ``path`` on ``device``.

    ``threads`` sets the intra-op threads (default: ONNX Runtime's, one per physical
    core). Models exported with ``custom_ops="domain"`` get the bladesmith operators'
    implementations (onnxruntime-extensions Python operators, run on the CPU).
    """
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise BladesmithError(f"{path}: no such ONNX file; export one with bladesmith.onnx.export")
    plan = plan_providers(
        device, ort.get_available_providers(), fp16=fp16, trt_cache_dir=trt_cache_dir
    )
    for _, provider_options in plan.providers:
        if "trt_engine_cache_path" in provider_options:
            Path(provider_options["trt_engine_cache_path"]).mkdir(parents=True, exist_ok=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Fatal only: every failure also raises, and is said once, in bladesmith's words (its
    # log would print a coloured copy of each, also for the batches a save only probes).
    options.log_severity_level = 4
    if threads is not None:
        options.intra_op_num_threads = threads
    if not _SPINNING.get():
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    for name, value in plan.session_settings.items():
        if name == "execution_mode":
            value = getattr(ort.ExecutionMode, value)
        setattr(options, name, value)
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    if _uses_custom_domain(model):
        options.register_custom_ops_library(_contrib_library(model, path))
    inference_session = ort.InferenceSession(
        str(path), sess_options=options, providers=plan.providers
    )
    return Session(inference_session, plan)


def _uses_custom_domain(model) -> bool:
    from bladesmith.onnx.symbolic import DOMAIN

    return any(opset.domain == DOMAIN for opset in model.opset_import)


def _contrib_library(model, path: Path) -> str:
    """onnxruntime-extensions' library, once the Python operators that ``model``'s
    custom nodes need are registered: bladesmith's, and the user's (``register_op``)."""
    from bladesmith.onnx.symbolic import OP_TYPES

    try:
        from onnxruntime_extensions import get_library_path

        from bladesmith.onnx import user_ops

        user_ops.prepare_session(model, str(path))
        if not any(node.op_type in OP_TYPES.values() for node in model.graph.node):
            return get_library_path()
        from bladesmith.onnx import contrib_ops
    except ImportError as error:
        raise BladesmithError(
            f"{path} has custom operators (exported with custom_ops='domain' or "
            "register_op's custom nodes), which run through onnxruntime-extensions, and it "
            f"cannot be imported ({error}): pip install onnxruntime-extensions, or re-export "
            "with custom_ops='standard'"
        ) from error
    return contrib_ops.library_path()
