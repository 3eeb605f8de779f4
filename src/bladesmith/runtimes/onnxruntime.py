"""ONNX Runtime: a module exported to ONNX and run in a session on the CPU, the runner
that the onnxruntime pass builds and that ``.onnx`` artifacts hold (bladesmith's metadata,
with the output structure that ONNX's flat outputs are unflattened into, in the model's
metadata properties).

Exports leave the first dimension of every input free, so that one session serves any
batch size; a module whose graph fixes its batch anyway gets ``OnnxRunnerPerShape``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from bladesmith.runtimes.built_for import follows_the_batch, tensors_in
from bladesmith.runtimes.format import Format

SUFFIX = ".onnx"


class OnnxRunner:
    """An ONNX Runtime session called like the module it was exported from: tensor
    arguments in, the module's output structure out (as CPU tensors). ``none_outputs``:
    the positions, among the output's leaves, of the Nones that ONNX has no output for."""

    def __init__(self, session, output_spec, none_outputs=()):
        self.session = session
        self.output_spec = output_spec
        self.none_outputs = tuple(none_outputs)

    def __call__(self, *args, **kwargs):
        # A bool or number the export held as a constant must not silently answer for another.
        self.session.check_arguments(args, kwargs)
        tensors = tensors_in((args, kwargs))
        unseen = [name for name, value in kwargs.items() if tensors_in(value)]
        if unseen and len(tensors) > len(self.session.input_names):
            self._refuse_unexported(unseen)
        outputs = list(self.session(*tensors))
        for index in self.none_outputs:  # ascending: each goes back where it was
            outputs.insert(index, None)
        return pytree.tree_unflatten(outputs, self.output_spec)

    def _refuse_unexported(self, unseen: list[str]) -> None:
        """Keyword tensors the export never saw (an optional argument the test data left
        out): the graph has no input for them, and would answer without them. (Too many
        positional ones the session itself refuses.)"""
        from bladesmith.errors import BladesmithError

        raise BladesmithError(
            f"{', '.join(unseen)}: this ONNX model was exported from calls without "
            f"{'it' if len(unseen) == 1 else 'them'} (its inputs: "
            f"{', '.join(self.session.input_names)}); export it again from such a call "
            "(bladesmith.optimize: test data that passes it)"
        )


class OnnxRunnerPerShape:
    """ONNX Runtime sessions of a module whose export fixes its shapes: one per input
    shape, exported from the module the first time that shape comes."""

    def __init__(self, module, example_args: tuple, runner: OnnxRunner):
        self.module = module
        self.runners = {_shapes(example_args): runner}

    def __call__(self, *args, **kwargs):
        shapes = _shapes((args, kwargs))
        if shapes not in self.runners:
            self.runners[shapes] = fixed_shape_runner(self.module, args)
        return self.runners[shapes](*args, **kwargs)


def _shapes(tree) -> tuple:
    return tuple(tuple(tensor.shape) for tensor in tensors_in(tree))


def export_onnx(
    module, args: tuple, path: Path, dynamic_batch: bool = True
) -> tuple[pytree.TreeSpec, tuple[int, ...]]:
    """Export ``module`` called on ``args`` to ``path``; return its output structure and
    the positions of the Nones among its leaves (the export drops them).

    With ``dynamic_batch`` the first dimension of every tensor input and output is left
    free. Outputs are named ``output_<i>`` in order, as ``bladesmith serve`` names them.
    The bladesmith operators become custom-domain nodes running their CPU kernels when
    onnxruntime-extensions is installed, else standard ONNX operators."""
    from bladesmith import onnx

    with torch.no_grad():
        leaves, output_spec = pytree.tree_flatten(module(*args))
    none_outputs = tuple(index for index, leaf in enumerate(leaves) if leaf is None)
    custom_ops = "domain" if importlib.util.find_spec("onnxruntime_extensions") else "standard"
    tensors = tensors_in(args)
    names = [f"input_{index}" for index in range(len(tensors))]
    outputs = [leaf for leaf in leaves if leaf is not None]
    output_names = [f"output_{index}" for index in range(len(outputs))]
    dynamic = {
        name: {0: "batch"}
        for name, x in (*zip(names, tensors), *zip(output_names, outputs))
        if isinstance(x, torch.Tensor) and x.dim()
    }
    onnx.export(
        module,
        args,
        path,
        custom_ops=custom_ops,
        input_names=names,
        output_names=output_names,
        dynamic_axes=dynamic if dynamic_batch else None,
    )
    return output_spec, none_outputs


def export_for_any_batch(
    module,
    args: tuple,
    path: Path,
    step: Callable[[str], contextlib.AbstractContextManager] = lambda _: contextlib.nullcontext(),
) -> tuple[pytree.TreeSpec, tuple[int, ...], OnnxRunner | None]:
    """``export_onnx`` to ``path``, the batch dimension free where the session then
    answers as ``module`` at other batches (``follows_the_batch``), else exported again
    with shapes fixed: its graph keeps the example's batch somewhere (a Reshape of an
    R-CNN's boxes), which ONNX Runtime then refuses in one line, not mid-graph. Returns
    the output structure, the Nones' positions, and the session of a batch-free export
    (None for a fixed one). ``step(text)`` shows each step (``Context.step``)."""
    with step("exporting to ONNX, the batch dimension free"):
        output_spec, none_outputs = export_onnx(module, args, path)
        runner = cpu_runner(path, output_spec, none_outputs)
    with step("checking the ONNX Runtime session on a batch twice as large"):
        follows = follows_the_batch(runner, module, args)
    if follows:
        return output_spec, none_outputs, runner
    del runner  # its session's memory (a whole model's weights) before exporting again
    with step("exporting to ONNX, shapes fixed"):
        output_spec, none_outputs = export_onnx(module, args, path, dynamic_batch=False)
    return output_spec, none_outputs, None


def cpu_runner(
    path: Path, output_spec: pytree.TreeSpec, none_outputs: tuple[int, ...] = ()
) -> OnnxRunner:
    """An ONNX Runtime session on the CPU, as many threads as torch uses."""
    from bladesmith import onnx

    session = onnx.session(path, device="cpu", threads=torch.get_num_threads())
    return OnnxRunner(session, output_spec, none_outputs)


def fixed_shape_runner(module, args: tuple) -> OnnxRunner:
    """``module`` exported on ``args``, shapes fixed, and loaded in an ONNX Runtime CPU
    session."""
    with tempfile.TemporaryDirectory(prefix="bladesmith-onnx-") as directory:
        path = Path(directory) / "model.onnx"
        output_spec, none_outputs = export_onnx(module, args, path, dynamic_batch=False)
        return cpu_runner(path, output_spec, none_outputs)


def write(module, calls: list[tuple], path: Path, metadata: dict, *, key: str, **_) -> None:
    """``module`` exported on the first of ``calls`` (``export_for_any_batch``), with the
    metadata under ``key``."""
    import onnx

    output_spec, none_outputs, _ = export_for_any_batch(module, calls[0], path)
    model = onnx.load(str(path))
    entry = model.metadata_props.add()
    entry.key = key
    entry.value = json.dumps(
        {
            **metadata,
            "output_spec": pytree.treespec_dumps(output_spec),
            "none_outputs": list(none_outputs),
        }
    )
    onnx.save(model, str(path))


def metadata(path: Path, key: str) -> str | None:
    import onnx

    properties = onnx.load(str(path), load_external_data=False).metadata_props
    return next((p.value for p in properties if p.key == key), None)


def read(path: Path, info: dict, trust: bool = False) -> OnnxRunner:
    """ONNX Runtime's session: protobuf and ONNX's own operators, nothing the file brings
    (its operator libraries are ``formats.read``'s)."""
    output_spec = pytree.treespec_loads(info["output_spec"])
    return cpu_runner(path, output_spec, tuple(info.get("none_outputs", ())))


class OnnxRuntime(Format):
    suffix = SUFFIX
    description = "ONNX for ONNX Runtime on the CPU (bladesmith.onnx.export)"
    devices = ("cpu",)
    build_cost = "seconds"
    zip_archive = False
    needs_fake_kernels = False
    triton_backend = "onnxruntime"

    def refuses_operators(self, operators) -> str | None:
        from bladesmith.onnx import user_ops

        untranslated = sorted(op for op in operators if not user_ops.translation(op))
        if untranslated:
            has = "has" if len(untranslated) == 1 else "have"
            return (
                f"{', '.join(untranslated)} {has} no ONNX translation "
                f"({user_ops.REGISTER_CALL} or --onnx-op gives one)"
            )
        return None

    write = staticmethod(write)
    metadata = staticmethod(metadata)
    read = staticmethod(read)


FORMAT = OnnxRuntime()
