"""ONNX for the user's own operators: ``bladesmith.onnx.register_op``.

    bladesmith.onnx.register_op("myops::scale_clip")                    # a custom node
    bladesmith.onnx.register_op("myops::scale_clip", onnxscript=ScaleClip)  # standard ONNX
    bladesmith.onnx.register_op("myops::scale_clip", symbolic=my_symbolic)

A registration gives the TorchScript-based exporter the operator's translation, for
``bladesmith.onnx.export``, the onnxruntime pass and ``bladesmith.save(..., ".onnx")``:

- by default, one node of domain ``ai.onnx.contrib`` (the domain onnxruntime-extensions
  runs Python operators in), op type ``<namespace>_<name>``: tensor arguments are its
  inputs, scalar arguments its attributes, list arguments constant inputs. ONNX Runtime
  runs it with ``ort_impl`` (numpy arrays in, attributes as keywords, arrays out), by
  default the operator's own PyTorch kernel, so a file written with the default runs
  again in a new process once the operator's library is loaded;
- ``onnxscript``: an onnxscript function, called with the tensor arguments as inputs
  and the scalar arguments as attributes of the same names: a lowering to standard ONNX
  that any runtime can run, stored in the file as an ONNX function;
- ``symbolic``: a function ``(g, *arguments) -> outputs`` as ``torch.onnx``'s
  ``register_custom_op_symbolic`` takes, its scalar arguments already parsed.

Every exported file lists its custom nodes in its metadata (``METADATA_KEY``), so that
a session registers their ONNX Runtime implementations before it starts.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from bladesmith.errors import BladesmithError
from bladesmith.onnx.custom_nodes import DEFAULT_IMPL, DOMAIN, listed

REGISTER_CALL = "bladesmith.onnx.register_op"
_ARGUMENT_KINDS = {  # schema type -> torch.onnx symbolic_helper.parse_args kind
    "float": "f",
    "int": "i",
    "bool": "b",
    "str": "s",
    "int[]": "is",
    "float[]": "fs",
    "SymInt": "i",
    "SymInt[]": "is",
}


@dataclass(frozen=True)
class Translation:
    name: str  # "myops::scale_clip"
    op_type: str
    symbolic: Callable | None = None
    onnxscript: object = None
    ort_impl: Callable | None = None

    @property
    def custom_node(self) -> bool:
        return self.symbolic is None and self.onnxscript is None


_TRANSLATIONS: dict[str, Translation] = {}
_ORT_REGISTERED: dict[str, tuple] = {}  # op type -> the types it was registered with


def register_op(
    name: str,
    *,
    symbolic: Callable | None = None,
    onnxscript=None,
    ort_impl: Callable | None = None,
    op_type: str | None = None,
) -> None:
    """Give operator ``name`` ("namespace::op") an ONNX translation (see the module
    docstring). Registering a name again replaces its translation."""
    if "::" not in name:
        raise BladesmithError(f"{REGISTER_CALL}: expected 'namespace::op', got {name!r}")
    if symbolic is not None and onnxscript is not None:
        raise BladesmithError(f"{REGISTER_CALL}({name!r}): give symbolic or onnxscript, not both")
    if ort_impl is not None and (symbolic is not None or onnxscript is not None):
        raise BladesmithError(
            f"{REGISTER_CALL}({name!r}): ort_impl runs the custom node, which symbolic and "
            "onnxscript replace"
        )
    op_type = op_type or name.replace("::", "_").replace(".", "_")
    _TRANSLATIONS[name] = Translation(name, op_type, symbolic, onnxscript, ort_impl)


def translation(name: str) -> Translation | None:
    return _TRANSLATIONS.get(name)


def missing_translation_message(name: str) -> str:
    return (
        f"ONNX export: operator {name} has no ONNX translation; register one with "
        f'{REGISTER_CALL}("{name}") (a custom node run by its PyTorch kernel), or with '
        "onnxscript= or symbolic= for standard ONNX (docs/operators.md: the user's operators "
        "in ONNX)"
    )


def not_standard_message(name: str) -> str:
    return (
        f"custom_ops='standard' (--custom-ops standard): {name} is registered as a custom "
        "node (--onnx-op, or register_op without onnxscript=), which is not standard ONNX: "
        f'lower it with {REGISTER_CALL}("{name}", onnxscript=...) from Python, or export '
        "with custom_ops='domain' (it then runs in bladesmith.onnx.session with its "
        "library loaded)"
    )


def check_translations(operators, custom_ops: str = "domain") -> None:
    """One line for the first of the user's ``operators`` with no translation, or, in
    ``"standard"`` mode, with a custom node for one."""
    for name in sorted(operators):
        if name not in _TRANSLATIONS:
            raise BladesmithError(missing_translation_message(name))
        if custom_ops == "standard" and _TRANSLATIONS[name].custom_node:
            raise BladesmithError(not_standard_message(name))


@contextlib.contextmanager
def registered(opset: int, custom_ops: str = "domain") -> Iterator[dict[str, int]]:
    """Every translation registered with the exporter for one export; yields the custom
    opsets (domain -> version) the file needs. In ``"standard"`` mode an operator the
    export meets whose translation is a custom node is refused."""
    import torch.onnx

    opsets = {}
    names = []
    try:
        for name, entry in _TRANSLATIONS.items():
            schema = _schema(name)
            if custom_ops == "standard" and entry.custom_node:
                translate = _not_standard(name)
            else:
                translate = _symbolic(entry, schema)
            torch.onnx.register_custom_op_symbolic(name, translate, opset)
            names.append(name)
            if entry.onnxscript is not None:
                opsets[entry.onnxscript.opset.domain] = entry.onnxscript.opset.version
            elif entry.custom_node:
                opsets[DOMAIN] = 1
        yield opsets
    finally:
        for name in names:
            torch.onnx.unregister_custom_op_symbolic(name, opset)


def _schema(name: str):
    schemas = torch._C._jit_get_schemas_for_operator(name)
    if not schemas:
        raise BladesmithError(
            f"{REGISTER_CALL}({name!r}): no such operator is loaded; load its library "
            "first (torch.ops.load_library, or --load-library)"
        )
    return schemas[0]


def _not_standard(name: str) -> Callable:
    """The translation of a custom node in standard mode: a refusal, for the modules whose
    operators the export meets only as it traces them."""

    def refuse(g, *values):
        raise BladesmithError(not_standard_message(name))

    return refuse


def _symbolic(entry: Translation, schema) -> Callable:
    from torch.onnx import symbolic_helper

    kinds = [_ARGUMENT_KINDS.get(str(argument.type), "v") for argument in schema.arguments]
    names = [argument.name for argument in schema.arguments]
    outputs = len(schema.returns)

    def translate(g, *values):
        # parse_args(*kinds) would do this, but it zips with the function's named
        # parameters, of which this one has none.
        values = [
            value if kind == "v" else symbolic_helper._parse_arg(value, kind)
            for value, kind in zip(values, kinds)
        ]
        if entry.symbolic is not None:
            return entry.symbolic(g, *values)
        tensors, attributes = [], {}
        for name, kind, value in zip(names, kinds, values):
            if kind == "v":
                tensors.append(value)
            elif entry.onnxscript is not None:
                attributes[f"{name}_{kind[0]}"] = value
            elif kind in ("is", "fs"):  # Python operators read scalar attributes only
                dtype = torch.int64 if kind == "is" else torch.float32
                tensors.append(g.op("Constant", value_t=torch.tensor(value, dtype=dtype)))
            else:
                attributes[f"{name}_{'i' if kind == 'b' else kind}"] = value
        if entry.onnxscript is not None:
            result = g.onnxscript_op(entry.onnxscript, *tensors, outputs=outputs, **attributes)
        else:
            result = g.op(f"{DOMAIN}::{entry.op_type}", *tensors, outputs=outputs, **attributes)
        _set_types(g, result, entry.name, schema, values)
        return result

    return translate


def _set_types(g, result, name: str, schema, values) -> None:
    """Give the new outputs their types, so that the nodes after them can be translated
    (a later convolution or reduction needs its input's dtype) and the file declares
    them: the operator's own kernel run on stand-ins for its inputs, else the traced
    node's types where the tracer knew them."""
    outputs = result if isinstance(result, (list, tuple)) else (result,)
    ran = _kernel_types(name, schema, values)
    for index, value in enumerate(outputs):
        if ran is not None and index < len(ran):
            value.setType(ran[index])
            continue
        known = g.original_node.outputsAt(index).type()
        if known.kind() == "TensorType" and known.scalarType() is not None:
            value.setType(known)


def _kernel_types(name: str, schema, values) -> list | None:
    """The output types of operator ``name`` called on tensors of its inputs' types
    (dtype and sizes as ONNX inferred them so far), or None when those are unknown or
    the kernel refuses the stand-ins. A size the export leaves free (the batch) is
    tried at two values: the output dimensions that follow it are left free too, the
    others keep their size. A traced node's sizes would be the example's, which
    declared outputs of a free batch with the test batch (ONNX Runtime warns on every
    other batch); a scripted model's nodes have no types at all."""
    tensor_types = {}
    for index, (argument, value) in enumerate(zip(schema.arguments, values)):
        if str(argument.type) != "Tensor":
            continue
        kind = value.type()
        if kind.kind() != "TensorType" or kind.scalarType() is None:
            return None
        sizes = kind.varyingSizes()
        if sizes is None:
            return None
        tensor_types[index] = (kind.dtype(), sizes)
    if not tensor_types:
        return None
    free = any(size is None for _, sizes in tensor_types.values() for size in sizes)
    runs = [
        _run_on_stand_ins(name, values, tensor_types, stand_in) for stand_in in (2, 3)[: 1 + free]
    ]
    if any(run is None for run in runs):
        return None
    types = []
    for outputs in zip(*runs):
        first = outputs[0]
        sizes = [
            size if all(o.shape[dim] == size for o in outputs) else None
            for dim, size in enumerate(first.shape)
        ]
        types.append(torch._C.TensorType.create_from_tensor(first).with_sizes(sizes))
    return types


def _run_on_stand_ins(name: str, values, tensor_types: dict, stand_in: int) -> list | None:
    """The operator's outputs on stand-ins: random tensors of the known types, each
    free size ``stand_in``; the other arguments as the export parsed them."""
    namespace, _, op_name = name.partition("::")
    op = getattr(getattr(torch.ops, namespace), op_name)
    args = list(values)
    for index, (dtype, sizes) in tensor_types.items():
        shape = [stand_in if size is None else size for size in sizes]
        args[index] = (
            torch.rand(shape, dtype=dtype)
            if dtype.is_floating_point
            else torch.ones(shape, dtype=dtype)
        )
    try:
        with torch.no_grad():
            result = op(*args)
    except Exception:  # stand-ins the kernel refuses: fall back to the traced types
        return None
    outputs = result if isinstance(result, (list, tuple)) else (result,)
    if not all(isinstance(output, torch.Tensor) for output in outputs):
        return None
    return list(outputs)


def custom_nodes_metadata(model) -> str | None:
    """What a session needs to run the user's custom nodes in ``model`` (an
    ``onnx.ModelProto``), as JSON; None when it has none."""
    used = {node.op_type for node in model.graph.node if node.domain == DOMAIN}
    entries = [
        {
            "operator": entry.name,
            "op_type": entry.op_type,
            "ort_impl": DEFAULT_IMPL if entry.ort_impl is None else "custom",
        }
        for entry in _TRANSLATIONS.values()
        if entry.custom_node and entry.op_type in used
    ]
    return json.dumps(entries) if entries else None


def prepare_session(model, source: str) -> bool:
    """Register with onnxruntime-extensions the Python operators that the custom nodes of
    ``model`` (an ``onnx.ModelProto`` read from ``source``) need; whether there were any."""
    entries = listed(model)
    if not entries:
        return False
    types = _value_types(model)
    for entry in entries:
        nodes = [
            n for n in model.graph.node if n.domain == DOMAIN and n.op_type == entry["op_type"]
        ]
        if nodes:
            _register_ort(entry, nodes[0], types, source)
    return True


def _value_types(model) -> dict[str, int]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {t.name: t.data_type for t in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    for node in graph.node:
        if node.op_type == "Constant":
            types[node.output[0]] = node.attribute[0].t.data_type
    return types


def _register_ort(entry: dict, node, types: dict[str, int], source: str) -> None:
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    name, op_type = entry["operator"], entry["op_type"]
    known = _TRANSLATIONS.get(name)
    if known is not None and known.ort_impl is not None:
        impl = known.ort_impl
    elif entry["ort_impl"] == DEFAULT_IMPL:
        if not torch._C._jit_get_schemas_for_operator(name):
            from bladesmith.ops.libraries import LIBRARY_FLAG

            raise BladesmithError(
                f"{source}: its node {op_type} runs operator {name}, which is not loaded; "
                f"load its library with {LIBRARY_FLAG} PATH (Python: torch.ops.load_library)"
            )
        impl = _pytorch_kernel(name)
    else:
        raise BladesmithError(
            f"{source}: its node {op_type} needs the ONNX Runtime implementation registered "
            f'for {name}: call {REGISTER_CALL}("{name}", ort_impl=...) before the session'
        )
    dt = {
        1: PyCustomOpDef.dt_float,
        2: PyCustomOpDef.dt_uint8,
        3: PyCustomOpDef.dt_int8,
        6: PyCustomOpDef.dt_int32,
        7: PyCustomOpDef.dt_int64,
        9: PyCustomOpDef.dt_bool,
        10: PyCustomOpDef.dt_float16,
        11: PyCustomOpDef.dt_double,
    }
    first = types.get(node.input[0], 1) if node.input else 1
    inputs = [dt.get(types.get(value, 1), PyCustomOpDef.dt_float) for value in node.input]
    outputs = [dt.get(types.get(value, first), PyCustomOpDef.dt_float) for value in node.output]
    attrs = {
        a.name: PyCustomOpDef.dt_float if a.type == a.FLOAT else PyCustomOpDef.dt_int64
        for a in node.attribute
        if a.type in (a.FLOAT, a.INT)
    }
    attrs.update({a.name: PyCustomOpDef.dt_string for a in node.attribute if a.type == a.STRING})
    signature = (tuple(inputs), tuple(outputs), tuple(sorted(attrs.items())), impl)
    if _ORT_REGISTERED.get(op_type) == signature:
        return
    onnx_op(op_type=op_type, inputs=inputs, outputs=outputs, attrs=attrs)(impl)
    _ORT_REGISTERED[op_type] = signature


@functools.cache  # one function per operator: a second session finds it registered
def _pytorch_kernel(name: str) -> Callable:
    """numpy in, numpy out through the operator's PyTorch kernel: the schema's tensor
    and list arguments come as inputs (in order), its scalars as attributes."""
    import numpy as np

    schema = _schema(name)
    namespace, _, op_name = name.partition("::")
    op = getattr(getattr(torch.ops, namespace), op_name)
    arguments = [(a.name, _ARGUMENT_KINDS.get(str(a.type), "v")) for a in schema.arguments]

    def run(*arrays, **attributes):
        arrays = iter(arrays)
        args = []
        for argument, kind in arguments:
            if kind == "v":
                args.append(torch.from_numpy(np.ascontiguousarray(next(arrays))))
            elif kind in ("is", "fs"):
                args.append(next(arrays).tolist())
            elif kind == "b":
                args.append(bool(attributes[argument]))
            else:
                args.append(attributes[argument])
        with torch.no_grad():
            result = op(*args)
        if isinstance(result, (tuple, list)):
            return tuple(t.contiguous().numpy() for t in result)
        return result.contiguous().numpy()

    return run
