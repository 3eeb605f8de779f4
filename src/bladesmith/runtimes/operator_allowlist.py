"""The operators a model file's graph may call without ``--trust``: an allowlist of what
computes, checked on the graph without running it (docs/security.md, "Trust model").

An operator is allowed when it is the user's own (registered in this process outside
torch's namespaces: a library loaded with ``--load-library``, or one an artifact brings,
loaded under ``--trust``), or one of torch's (``aten``, ``prim``), torchvision's or
bladesmith's own and every argument of its schema is of a computing type: tensors,
numbers, devices, dtypes and containers of them, and strings only where the argument
picks a mode (``mode``, ``padding``, ``reduce``...) or is a TorchScript string method's.
That keeps out, without naming them, every operator that reaches outside the process's
tensors: ``aten::from_file`` and ``aten::save`` (a ``filename``), ``aten::set_`` of a
``Storage``, anything with an ``Any`` or object argument. Graph nodes without a schema
are allowed by kind (constants, control flow, containers, attributes); a call that stays
a call after inlining (an interface's method, a fork, a Python op) is not.
"""

from __future__ import annotations

import operator
import re

import torch

from bladesmith.ops.libraries import is_user_operator

_NAMESPACES = frozenset({"aten", "prim", "torchvision", "bladesmith"})

# Schema-less node kinds: values, control flow, containers, a module's own attributes.
_STRUCTURAL = frozenset(
    {
        "prim::Constant",
        "prim::If",
        "prim::Loop",
        "prim::GetAttr",
        "prim::SetAttr",
        "prim::ListConstruct",
        "prim::ListUnpack",
        "prim::TupleConstruct",
        "prim::TupleUnpack",
        "prim::TupleIndex",
        "prim::TupleSlice",
        "prim::DictConstruct",
        "prim::CreateObject",
        "prim::Uninitialized",
        "prim::unchecked_cast",
        "prim::isinstance",
        "prim::EnumValue",
        "prim::AutogradZero",
    }
)

# Argument types that hold only values: a type string's words must all be these.
_VALUE_TYPES = frozenset(
    {
        "Tensor",
        "int",
        "float",
        "bool",
        "complex",
        "number",
        "Scalar",
        "ScalarType",
        "Layout",
        "Device",
        "MemoryFormat",
        "Generator",
        "SymInt",
        "Dimname",
        "NoneType",
        "Optional",
        "List",
        "Tuple",
        "Dict",
        "t",
        "t1",
        "t2",
        "tVal",
        "str",
    }
)
_TYPE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Where a string argument is allowed: it picks a mode of a computation, or is the
# string a TorchScript string method works on. A file name is none of these.
_STRING_ARGUMENTS = frozenset(
    {
        # modes
        "mode",
        "padding",
        "padding_side",
        "pad_mode",
        "approximate",
        "reduce",
        "rounding_mode",
        "equation",
        "indexing",
        "interpolation",
        "norm",
        "ord",
        "p",
        "UPLO",
        "driver",
        "side",
        "type",
        "device_type",
        "activation",
        "algorithm",
        # messages
        "msg",
        "cls",
        "message",
        "assert_msg",
        "api_name",
        # TorchScript's string, list and dict methods
        "self",
        "a",
        "b",
        "s",
        "string",
        "substr",
        "separator",
        "chars",
        "fillchar",
        "old",
        "new",
        "el",
        "item",
        "key",
        "idx",
        "ind",
        "values",
        "input",
        "inputs",
        "dict",
        "l",
        "to_add",
        "t",
    }
)

# What a torch.export graph may call besides operators: Python's own on its values.
_PYTHON_CALLS = frozenset(
    {operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv}
)


def refused_operator(schema: torch._C.FunctionSchema) -> str | None:
    """Why the operator of ``schema`` is outside the allowlist, or None. The user's own
    operators (registered in this process, by a library the user loaded or code the user
    ran, in a namespace that is not torch's) are the user's code, not the file's."""
    namespace = schema.name.partition("::")[0]
    if namespace not in _NAMESPACES and is_user_operator(schema.name):
        return None
    if namespace not in _NAMESPACES:
        return f"{schema.name} (not torch's, torchvision's or bladesmith's operator)"
    for argument in schema.arguments:
        kind = str(argument.type)
        words = set(_TYPE_WORD.findall(kind))
        if not words <= _VALUE_TYPES:
            return f"{schema.name} (argument {argument.name}: {kind})"
        if "str" in words and argument.name not in _STRING_ARGUMENTS:
            return f"{schema.name} (argument {argument.name}: {kind})"
    return None


def refused_in_graph(graph: torch._C.Graph) -> str | None:
    """The first node of ``graph`` (inlined first: every function and method it calls,
    with theirs) outside the allowlist, said in a few words, or None."""
    inlined = graph.copy()
    torch._C._jit_pass_inline(inlined)
    return _refused_in_block(inlined.nodes())


def _refused_in_block(nodes) -> str | None:
    for node in nodes:
        kind = node.kind()
        if kind not in _STRUCTURAL:
            text = node.schema()
            if text == "(no schema)":
                return kind
            why = refused_operator(torch._C.parse_schema(text))
            if why is not None:
                return why
        for block in node.blocks():
            why = _refused_in_block(block.nodes())
            if why is not None:
                return why
    return None


def refused_in_script_module(module: torch.jit.ScriptModule) -> str | None:
    """The first call outside the allowlist in any method or hook of ``module`` or of
    its submodules (``method (why)``), or None."""
    for name, each in module.named_modules():
        scripted = each._c
        graphs = [(m, scripted._get_method(m).graph) for m in scripted._method_names()]
        hooks = [*scripted._get_forward_pre_hooks(), *scripted._get_forward_hooks()]
        graphs += [(hook.name, hook.graph) for hook in hooks]
        for method, graph in graphs:
            why = refused_in_graph(graph)
            if why is not None:
                return f"{name + '.' if name else ''}{method} calls {why}"
    return None


def refused_in_exported(program: torch.export.ExportedProgram) -> str | None:
    """The first call of a torch.export program's graph outside the allowlist, or None."""
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            target = node.target
            if node.op != "call_function":
                return f"{node.name} ({node.op})"
            if target in _PYTHON_CALLS:
                continue
            schema = getattr(target, "_schema", None)
            if not isinstance(target, torch._ops.OpOverload) or schema is None:
                return f"{node.name} calls {target!r}"
            why = refused_operator(schema)
            if why is not None:
                return why
    return None
