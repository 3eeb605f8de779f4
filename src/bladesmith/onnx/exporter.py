"""``export``: a PyTorch model that uses the bladesmith operators, to a checked ONNX file.

The TorchScript-based exporter (``torch.onnx.export(dynamo=False)``) is used on
purpose: it takes nn.Modules and TorchScript files alike, behaves the same on every
supported torch (2.6 and newer), and runs the model, so the operators' real kernels
give every output its static shape. ``bladesmith.onnx.symbolic`` translates the
operators. The file is written next to its destination, shape-inferred and checked
(``onnx.checker.check_model(full_check=True)``), then renamed into place.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from bladesmith._files import move_into_place
from bladesmith.errors import BladesmithError, said
from bladesmith.onnx import sessions, symbolic, user_ops
from bladesmith.onnx.custom_nodes import METADATA_KEY
from bladesmith.ops import libraries

# Protocol buffers cannot be serialised past 2 GiB; keep a margin for the graph itself.
_EXTERNAL_DATA_THRESHOLD = 1.8 * 2**30


def export(
    model: torch.nn.Module,
    args,
    path: str | os.PathLike,
    *,
    opset: int = 17,
    custom_ops: str = "domain",
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    external_data: bool | None = None,
    dynamic_axes: dict[str, dict[int, str]] | None = None,
) -> Path:
    """Export ``model`` called on ``args`` (a tensor or a tuple of them) to ``path``.

    ``custom_ops="domain"`` makes each bladesmith operator one ``ai.onnx.contrib`` node,
    run by ``bladesmith.onnx.session``; ``"standard"`` lowers them to standard ONNX
    operators with the same fixed-shape outputs, for any ONNX Runtime provider and
    TensorRT. Weights go to ``<path>.data`` when ``external_data`` is True, or when it
    is None and they are too large for one protobuf (2 GiB). ``dynamic_axes`` names the
    dimensions left free, by input or output name (``{"input_0": {0: "batch"}}``, as
    ``torch.onnx.export`` takes them). Returns ``path``.
    The user's own operators need a translation (``bladesmith.onnx.register_op``).
    """
    from bladesmith import ops

    symbolic.check_mode(custom_ops, opset)
    args = args if isinstance(args, tuple) else (args,)
    path = Path(path)
    if path.suffix != ".onnx":
        raise BladesmithError(f"{path}: an ONNX file name must end in .onnx")
    path.parent.mkdir(parents=True, exist_ok=True)
    ops.load_library()
    if isinstance(model, torch.jit.ScriptModule):  # its graph names them: check first
        _check_all_arguments_given(model, args)
        _check_arguments_are_tensors(model)
        user_ops.check_translations(libraries.operators_called(model), custom_ops)
    workdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        raw = workdir / "raw.onnx"
        exported = _given_arguments_only(model, args)
        _torch_export(
            exported, args, raw, opset, custom_ops, input_names, output_names, dynamic_axes
        )
        _finish(raw, workdir / path.name, external_data, baked_arguments(model, args))
        _move_into_place(workdir, path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return path


def _torch_export(
    model, args, raw: Path, opset, custom_ops, input_names, output_names, dynamic_axes
):
    custom_opsets = {symbolic.DOMAIN: symbolic.DOMAIN_VERSION} if custom_ops == "domain" else {}
    with (
        symbolic.registered(custom_ops, opset),
        user_ops.registered(opset, custom_ops) as user_opsets,
        warnings.catch_warnings(),
        torch.no_grad(),
        _mha_fastpath_off(),
        _training_mode(model) as training,
        _graph_dump_dropped(),
    ):
        # A domain the graph uses is declared at version 1 by the exporter itself; one
        # declared here and unused makes torch warn on stderr ("Custom opset domain ...
        # is not used"), so only other versions are declared.
        custom_opsets = {
            domain: version
            for domain, version in {**user_opsets, **custom_opsets}.items()
            if version != 1
        }
        # The TorchScript exporter is chosen deliberately (see the module docstring).
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            torch.onnx.export(
                model,
                args,
                str(raw),
                dynamo=False,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                custom_opsets=custom_opsets,
                do_constant_folding=True,
                training=training,
            )
        except BladesmithError:
            raise
        except torch.onnx.errors.UnsupportedOperatorError as error:
            name = _unsupported_operator(str(error))
            if name is None or not libraries.is_user_operator(name):
                raise _export_error(error, opset) from error
            raise BladesmithError(user_ops.missing_translation_message(name)) from None
        except Exception as error:  # the exporter's own errors, re-said with what to do
            raise _export_error(error, opset) from error


@contextlib.contextmanager
def _graph_dump_dropped():
    """The process's stdout (file descriptor 1) held in a file while the exporter runs,
    and written out after it unless it failed: on a failure the exporter prints the
    whole TorchScript graph there from C++ (thousands of lines for a real model; its ONNX
    log is left on, as ``setup_onnx_logging`` tests a function rather than its value),
    where the error is one line."""
    _flush_stdout()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 1)
        failed = True
        try:
            yield
            failed = False
        finally:
            _flush_stdout()
            os.dup2(saved, 1)
            os.close(saved)
            held.seek(0)
            printed = held.read()
            if printed and not failed and sys.stdout is not None:
                sys.stdout.write(printed.decode(errors="replace"))
                sys.stdout.flush()


def _flush_stdout() -> None:
    if sys.stdout is not None:
        sys.stdout.flush()


def _given_arguments_only(model, args):
    """``model``, or a module that calls it with ``args`` alone where its ``forward`` has
    parameters beyond them with number or bool defaults: the TorchScript exporter passes
    such defaults to the trace as tensors, and an operator that takes a bool fails
    (nn.TransformerEncoderLayer's ``is_causal``: "must be bool, not Tensor")."""
    if not isinstance(model, torch.nn.Module) or isinstance(model, torch.jit.ScriptModule):
        return model
    given = len(args) if isinstance(args, tuple) else 1
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())[given:]
    except (TypeError, ValueError):
        return model
    if not any(isinstance(p.default, (bool, int, float)) for p in parameters):
        return model
    wrapper = _Forward(model)
    wrapper.training = model.training  # the exporter restores this mode on the model after
    return wrapper


def _check_all_arguments_given(model: torch.jit.ScriptModule, args: tuple) -> None:
    """The TorchScript exporter calls a scripted ``forward`` with the tensors passed and
    none of its defaults: an argument left out failed inside torch ("INTERNAL ASSERT
    FAILED ... 12 vs 11")."""
    try:
        parameters = model.forward.schema.arguments[1:]  # after self
    except (AttributeError, RuntimeError):  # no forward method to read
        return
    left = [f"{p.name}: {p.type} = {p.default_value}" for p in parameters[len(args) :]]
    if left:
        raise BladesmithError(
            f"ONNX export: the scripted forward's argument {', '.join(left)} is left at its "
            "default, and the export of a TorchScript model needs every argument given as "
            "a tensor: export from Python with a tensor for it (bladesmith.onnx.export("
            "model, (x, ...), path)), or script a module whose forward calls this one "
            "without it"
        )


def _check_arguments_are_tensors(model: torch.jit.ScriptModule) -> None:
    """An ONNX graph takes tensors (and sequences of them) as inputs: the TorchScript
    exporter wrote a scripted forward's list of dicts as an input of no type, which
    ONNX's shape inference refused as "Invalid tensor data type 0."."""
    try:
        parameters = model.forward.schema.arguments[1:]  # after self
    except (AttributeError, RuntimeError):  # no forward method to read
        return
    for parameter in parameters:
        if _holds_dict_or_string(parameter.type):
            raise BladesmithError(
                f"ONNX export: the scripted forward's argument {parameter.name}: "
                f"{parameter.type} is not a tensor, nor a tuple or list of them, which is "
                "all an ONNX graph takes as inputs: export the nn.Module from Python (its "
                "trace takes the tensors out of the dicts), or script a module whose "
                "forward takes the tensors"
            )


def _holds_dict_or_string(kind) -> bool:
    if isinstance(kind, (torch._C.DictType, torch._C.StringType)):
        return True
    if isinstance(kind, (torch._C.ListType, torch._C.OptionalType)):
        return _holds_dict_or_string(kind.getElementType())
    if isinstance(kind, torch._C.TupleType):
        return any(_holds_dict_or_string(each) for each in kind.elements())
    return False


class _Forward(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model(*args)


def baked_arguments(model, args: tuple) -> list[dict]:
    """The non-tensor values among ``args`` (a bool, a number, a string, None), which the
    export holds as constants in the graph: each with the argument it is (name, position,
    path inside it), its value where JSON holds it, and how it reads."""
    from torch.utils import _pytree as pytree

    names = _parameter_names(model)
    entries = []
    for position, argument in enumerate(args):
        parameter = names[position] if position < len(names) else None
        for key_path, leaf in pytree.tree_flatten_with_path(argument)[0]:
            if isinstance(leaf, torch.Tensor):
                continue
            path = pytree.keystr(key_path)
            entry = {
                "name": f"{parameter or f'argument {position}'}{path}",
                "parameter": parameter,
                "position": position,
                "path": path,
                "repr": sessions.describe_argument(leaf),
            }
            if leaf is None or isinstance(leaf, (bool, int, float, str)):
                entry["value"] = leaf
            entries.append(entry)
    return entries


def held_constants(model, args: tuple) -> list[str]:
    """ "name=value" of each non-tensor value among ``args`` that an export holds as a
    constant (None is left out: the graph just lacks that input)."""
    return [
        f"{entry['name']}={entry['repr']}"
        for entry in baked_arguments(model, args)
        if entry.get("value", ...) is not None
    ]


def _parameter_names(model) -> list[str]:
    """The names of ``model``'s positional parameters, as far as they are known."""
    try:
        if isinstance(model, torch.jit.ScriptModule):
            return [argument.name for argument in model.forward.schema.arguments[1:]]
        names = []
        for parameter in inspect.signature(model.forward).parameters.values():
            if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                break
            names.append(parameter.name)
        return names
    except (AttributeError, TypeError, ValueError):  # no signature to read
        return []


def _export_error(error: Exception, opset: int) -> BladesmithError:
    """The exporter's own error, re-said with what to do."""
    return BladesmithError(
        f"torch.onnx.export failed ({said(error)}). The model must "
        "trace with fixed-shape tensor inputs, and each of its operators needs an ONNX "
        f"translation at opset {opset} (a newer opset may have it)"
    )


def _unsupported_operator(message: str) -> str | None:
    """The operator an exporter's "unrecognized namespace" error names."""
    match = re.search(r"unrecognized namespace (\S+::\S+?)\.?(\s|$)", message)
    return match.group(1) if match else None


@contextlib.contextmanager
def _mha_fastpath_off():
    """nn.MultiheadAttention without its inference fast path, whose fused operator
    (``aten::_native_multi_head_attention``, what a ViT runs under no_grad) has no ONNX
    translation: the same attention exports as its matmuls and softmax."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def is_program_module(model) -> bool:
    """Whether ``model`` is a torch.export program's module (``ExportedProgram.module()``,
    what a .pt2 file loads as): it sets its own ``train``, which raises (its graph keeps
    the mode it was exported in)."""
    return "train" in getattr(model, "__dict__", {})


@contextlib.contextmanager
def _training_mode(model):
    """torch.onnx.export's ``training`` for ``model``: EVAL (the exporter calls
    ``model.train(False)``), or PRESERVE for a torch.export program's module
    (``is_program_module``), whose ``train()`` raises; its modules' ``training`` flags
    read False meanwhile, so that the exporter exports inference. Entered inside the
    export's ``warnings.catch_warnings()``, which undoes its filters."""
    if not is_program_module(model):
        yield torch.onnx.TrainingMode.EVAL
        return
    # Said of PRESERVE whatever the flags; and the program's input guards trace as
    # constants, which is what they are for one export.
    warnings.filterwarnings("ignore", message="It is recommended that constant folding")
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    modules = list(model.modules())
    flags = [module.training for module in modules]
    for module in modules:
        module.training = False
    try:
        yield torch.onnx.TrainingMode.PRESERVE
    finally:
        for module, flag in zip(modules, flags, strict=True):
            module.training = flag


def _finish(raw: Path, out: Path, external_data: bool | None, baked: list[dict]) -> None:
    """Shape-infer and check ``raw``, writing ``out`` (and ``out.data`` when external),
    with the ``baked`` arguments in its metadata."""
    import onnx

    model = onnx.load(str(raw))  # loads any external data the exporter wrote
    custom_nodes = user_ops.custom_nodes_metadata(model)
    if custom_nodes is not None:
        entry = model.metadata_props.add()
        entry.key, entry.value = METADATA_KEY, custom_nodes
    if baked:  # the session refuses other values for them (sessions.Session)
        entry = model.metadata_props.add()
        entry.key, entry.value = sessions.baked_arguments_metadata(baked)
    if external_data is None:
        weight_bytes = sum(t.ByteSize() for t in model.graph.initializer)
        external_data = weight_bytes > _EXTERNAL_DATA_THRESHOLD
    try:
        if external_data:
            onnx.save_model(
                model,
                str(out),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=f"{out.name}.data",
                size_threshold=1024,
            )
            del model
            onnx.shape_inference.infer_shapes_path(
                str(out), str(out), check_type=True, strict_mode=True, data_prop=True
            )
            onnx.checker.check_model(str(out), full_check=True)
        else:
            model = onnx.shape_inference.infer_shapes(
                model, check_type=True, strict_mode=True, data_prop=True
            )
            onnx.checker.check_model(model, full_check=True)
            onnx.save_model(model, str(out))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        if "tensor(bfloat16)" in str(error):  # the model's choice, not a bug of ours
            raise BladesmithError(
                "the model computes in bfloat16, which some of its ONNX operators refuse "
                f"({' '.join(str(error).split())[:200]}) and ONNX Runtime's CPU kernels do "
                "not take: export the model in float32 (bladesmith.optimize: exclude the "
                "bf16, roi_heads_bf16 and linear_bf16 passes)"
            ) from error
        raise BladesmithError(
            f"the exported model fails ONNX's checker: {error}. This is a bladesmith bug if "
            "the model only uses torch and bladesmith operators: please report it"
        ) from error


def _move_into_place(workdir: Path, path: Path) -> None:
    # External data first: the model file appears last, and never refers to missing data.
    data = workdir / f"{path.name}.data"
    if data.exists():
        move_into_place(data, path.parent / data.name)
    move_into_place(workdir / path.name, path)
