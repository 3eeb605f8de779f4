"""OpenVINO: a module converted to OpenVINO IR and compiled for the CPU, the runner that
the openvino pass builds and that ``.ov`` artifacts hold.

An IR is two files (the graph, ``model.xml``, and its weights, ``model.bin``), and every
bladesmith artifact is one file; so a ``.ov`` is a ZIP archive of the two and
bladesmith's metadata (``bladesmith.json``), stored uncompressed (weights do not shrink,
and reading stays a copy). The suffix names the runtime and is none that OpenVINO gives a
file of its own (``.xml``, ``.bin``, ``.blob``). Reading parses the IR from memory: no
code the file brings runs (an IR names OpenVINO's own operations; no extension, which
would be code, is ever loaded).

The model is compiled once per input signature, on its first call, with its shapes
fixed (OpenVINO's CPU kernels are fastest on static shapes). The settings it is compiled
with (``settings``: performance hint, threads, streams, and the inference precision
where one was asked for) are recorded in the artifact and applied on load; ``used``
reads back what OpenVINO applied, its precision included (bf16 by default on a CPU
with bf16 instructions).
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.utils import _pytree as pytree

from bladesmith.onnx import user_ops
from bladesmith.onnx.symbolic import LOWERED_TO_STANDARD
from bladesmith.runtimes.built_for import follows_the_batch, tensors_in
from bladesmith.runtimes.format import Format

SUFFIX = ".ov"
PACKAGE = "openvino"
_GRAPH, _WEIGHTS = "model.xml", "model.bin"
DEVICE = "CPU"
# OpenVINO's inference precision -> the torch dtype its arithmetic runs in.
PRECISIONS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# bladesmith's operators with a lowering to standard ONNX.
_BLADESMITH_LOWERED = frozenset(f"bladesmith::{name}" for name in LOWERED_TO_STANDARD)


def core():
    import openvino

    return openvino.Core()


def settings(hint: str, threads: int | None, streams: int | None, precision: str | None) -> dict:
    """OpenVINO's compile properties for ``Config``'s settings (None: OpenVINO's own)."""
    chosen = {"PERFORMANCE_HINT": hint.upper()}
    if threads is not None:
        chosen["INFERENCE_NUM_THREADS"] = threads
    if streams is not None:
        chosen["NUM_STREAMS"] = streams
    if precision is not None:
        chosen["INFERENCE_PRECISION_HINT"] = precision
    return chosen


class OpenVinoRunner:
    """An OpenVINO model called like the module it was converted from: tensors in, the
    module's output structure out (CPU tensors of the module's dtypes)."""

    def __init__(self, model, settings: dict, output_spec, output_dtypes: list[str]):
        self.model = model
        self.settings = dict(settings)
        self.output_spec = output_spec
        self.output_dtypes = [getattr(torch, name) for name in output_dtypes]
        self._requests = {}  # input shapes -> an infer request of a model compiled for them
        self._core = core()

    def _request(self, tensors: list[torch.Tensor]):
        shapes = tuple(tuple(x.shape) for x in tensors)
        if shapes not in self._requests:
            model = self.model.clone()
            model.reshape({port: list(shape) for port, shape in zip(model.inputs, shapes)})
            compiled = self._core.compile_model(model, DEVICE, self.settings)
            self._requests[shapes] = compiled.create_infer_request()
        return self._requests[shapes]

    def __call__(self, *args, **kwargs):
        tensors = [x.detach().cpu().contiguous() for x in tensors_in((args, kwargs))]
        request = self._request(tensors)
        request.infer([x.numpy() for x in tensors])
        outputs = [
            torch.from_numpy(np.array(request.get_output_tensor(index).data)).to(dtype)
            for index, dtype in enumerate(self.output_dtypes)
        ]
        return pytree.tree_unflatten(outputs, self.output_spec)

    def used(self) -> dict:
        """What OpenVINO compiled with (after a call): hint, threads, streams, precision."""
        if not self._requests:
            return {}
        compiled = next(iter(self._requests.values())).get_compiled_model()
        names = ("PERFORMANCE_HINT", "INFERENCE_NUM_THREADS", "NUM_STREAMS")
        used = {name: str(compiled.get_property(name)) for name in names}
        used["INFERENCE_PRECISION_HINT"] = precision_name(
            compiled.get_property("INFERENCE_PRECISION_HINT")
        )
        return used


def precision_name(element_type) -> str:
    """OpenVINO's element type as its short name: "f32", "bf16", "f16"."""
    return element_type.get_type_name()


def convert(module, args: tuple, via_onnx: bool = False) -> tuple:
    """``module`` converted on ``args``: the OpenVINO model, and the output structure and
    dtypes to give back. By OpenVINO's PyTorch frontend (torch's trace); ``via_onnx``,
    for a module calling bladesmith's operators, which that frontend has no rule for, by
    its ONNX frontend from bladesmith's export with the operators lowered to standard
    ONNX (NMS as NonMaxSuppression, one score plane per class: torchvision's per-class
    NMS, which OpenVINO's NonMaxSuppression computes too)."""
    import openvino

    with torch.no_grad():
        leaves, output_spec = pytree.tree_flatten(module(*args))
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        kinds = sorted({type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)})
        raise ValueError(f"the model returns {', '.join(kinds)} besides tensors")
    if via_onnx:
        from bladesmith.onnx import exporter

        with tempfile.TemporaryDirectory(prefix="bladesmith-openvino-") as directory:
            path = exporter.export(
                module, args, Path(directory) / "model.onnx", custom_ops="standard"
            )
            model = openvino.convert_model(str(path))
    else:
        model = openvino.convert_model(module, example_input=tensors_in(args))
    dtypes = [str(leaf.dtype).removeprefix("torch.") for leaf in leaves]
    return model, output_spec, dtypes


def lowered(operator: str) -> bool:
    """Whether bladesmith's ONNX export lowers ``operator``, which OpenVINO's PyTorch
    converter has no rule for, to standard ONNX (then ``convert(via_onnx=True)`` takes
    it): one of bladesmith's, or the user's registered with onnxscript= or symbolic=."""
    if operator in _BLADESMITH_LOWERED:
        return True
    translation = user_ops.translation(operator)
    return translation is not None and not translation.custom_node


def runner_for(module, args: tuple, chosen: dict, via_onnx: bool = False) -> OpenVinoRunner:
    model, output_spec, dtypes = convert(module, args, via_onnx)
    return OpenVinoRunner(model, chosen, output_spec, dtypes)


def write(module, calls: list[tuple], path: Path, metadata: dict, *, key: str, **options):
    """The runner the openvino pass built (``options["runner"]``) as IR in a ZIP, with
    the metadata (``key``.json): its settings, output structure and dtypes, and whether
    it follows the batch."""
    import openvino

    runner = options.get("runner")
    if not isinstance(runner, OpenVinoRunner):
        raise ValueError("only a result the openvino pass built is saved as OpenVINO IR")
    free = follows_the_batch(runner, module, calls[0])
    metadata["inputs"] = {
        "free_batch": free,
        "why": "OpenVINO compiles each input shape on its first call; this model's graph "
        + ("follows the batch" if free else "keeps its example's batch"),
    }
    metadata["openvino"] = {
        "settings": runner.settings,
        "output_spec": pytree.treespec_dumps(runner.output_spec),
        "output_dtypes": [str(d).removeprefix("torch.") for d in runner.output_dtypes],
        "version": openvino.get_version(),
    }
    with tempfile.TemporaryDirectory(prefix="bladesmith-openvino-") as directory:
        folder = Path(directory)
        # Weights as they are: OpenVINO would otherwise store them in float16.
        openvino.save_model(runner.model, folder / _GRAPH, compress_to_fp16=False)
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
            archive.write(folder / _GRAPH, _GRAPH)
            archive.write(folder / _WEIGHTS, _WEIGHTS)
            archive.writestr(f"{key}.json", json.dumps(metadata))


def metadata(path: Path, key: str) -> str | None:
    with zipfile.ZipFile(path) as archive:
        name = f"{key}.json"
        return archive.read(name).decode() if name in archive.namelist() else None


def read(path: Path, info: dict, trust: bool = False) -> OpenVinoRunner:
    """OpenVINO's graph and weights, read from memory with no extension loaded: the
    file brings no code, so ``trust`` changes nothing."""
    import openvino

    with zipfile.ZipFile(path) as archive:
        graph, weights = archive.read(_GRAPH), archive.read(_WEIGHTS)
    model = core().read_model(
        model=graph.decode(), weights=openvino.Tensor(np.frombuffer(weights, dtype=np.uint8))
    )
    saved = info["openvino"]
    output_spec = pytree.treespec_loads(saved["output_spec"])
    return OpenVinoRunner(model, saved["settings"], output_spec, saved["output_dtypes"])


class OpenVino(Format):
    suffix = SUFFIX
    description = "OpenVINO IR (model.xml + model.bin in one ZIP), compiled for the CPU"
    devices = ("cpu",)
    build_cost = "seconds"
    zip_archive = True
    needs_fake_kernels = False
    # pytriton's bundled tritonserver has no openvino backend: bladesmith's Python model.
    triton_backend = None
    only_its_pass = True
    package = PACKAGE

    def refuses(self, module, device) -> str | None:
        return self.missing_package() or super().refuses(module, device)

    def refuses_operators(self, operators) -> str | None:
        refused = sorted(op for op in operators if not lowered(op))
        if refused:
            return (
                f"OpenVINO's converters cannot take {', '.join(refused)} (the user's "
                "operators, with no lowering to standard ONNX: bladesmith.onnx.register_op "
                "with onnxscript= or symbolic= gives one)"
            )
        return None

    write = staticmethod(write)
    metadata = staticmethod(metadata)
    read = staticmethod(read)


FORMAT = OpenVino()
