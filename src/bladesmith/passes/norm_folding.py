"""norm_folding: batch norms folded into the convolutions before them, whose weights are
then kept channels_last (CPU).

In eval mode a batch norm is an affine map per channel, which the convolution before it
absorbs into its weights and bias; on the GPU Inductor's freezing does that, on the CPU
nothing else does (ResNet-50 keeps 40 of them after the winograd pass, about 10 ms a
call at 480x640 on two cores). The folded convolutions' weights are stored channels_last,
so the backbone runs channels_last from the stem on: oneDNN then reorders nothing, and
the stem's max pooling, 10 ms in NCHW, takes 1 ms.

The pairs are found in the graph torch.fx traces, so any ``forward`` that applies a
batch norm to a convolution's output and to nothing else folds (``self.bn1(self.conv1(x))``
in a hand-written block as well as an ``nn.Sequential``). A module that does not trace
(data-dependent control flow, as in a detector's post-processing) is searched child by
child: its traceable children through their graphs, its own direct children by structure
(the next child of a container that runs them in order).

A torch.export program has no modules to replace: its graph calls ATen's ``conv2d`` and
``batch_norm`` on its own weights. There the folded weights replace the convolution's
and the batch norm's call is removed (``exported_pairs``, ``fold_exported``).
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import torch
from torch import fx, nn

from bladesmith.convs import fold_affine, fold_norm, is_foldable_norm, norm_after
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass


class NormFolding(Pass):
    """Batch norms folded into the convolutions before them, weights channels_last (CPU)."""

    name = "norm_folding"
    rewrites_modules = True
    devices = ("cpu",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if not conv_norm_pairs(candidate.module) and not exported_pairs(candidate.module):
            return "the model has no convolution followed by a batch norm"
        return None

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        pairs = conv_norm_pairs(module)
        for conv_name, norm_name in pairs:
            conv, norm = module.get_submodule(conv_name), module.get_submodule(norm_name)
            _replace(module, conv_name, folded(conv, norm))
            _replace(module, norm_name, nn.Identity())
        count = len(pairs) + fold_exported(module)
        context.notes.append(f"norm_folding: {count} batch norms folded")
        return candidate.with_module(module, self.name)


def conv_norm_pairs(module: nn.Module) -> list[tuple[str, str]]:
    """(convolution's name, batch norm's name), qualified from ``module``, of each plain
    2-D convolution whose output only a foldable batch norm reads. Modules registered
    under more than one name are left out: folding one would change the other use."""
    pairs: list[tuple[str, str]] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        graph = _traced(parent)
        if graph is not None:
            pairs.extend((prefix + conv, prefix + norm) for conv, norm in _graph_pairs(graph))
            return
        children = list(parent.named_children())
        for position, (name, child) in enumerate(children):
            norm = norm_after(parent, children, position) if type(child) is nn.Conv2d else None
            if norm is not None:
                pairs.append((prefix + name, prefix + norm))
            else:
                visit(f"{prefix}{name}.", child)

    visit("", module)
    uses = Counter(id(each) for _, each in module.named_modules(remove_duplicate=False))
    return [
        (conv, norm)
        for conv, norm in pairs
        if uses[id(module.get_submodule(conv))] == 1 and uses[id(module.get_submodule(norm))] == 1
    ]


class _Tracer(fx.Tracer):
    """torch.fx's tracer, with frozen batch norms (torchvision's) kept as single calls."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return is_foldable_norm(module) or super().is_leaf_module(module, qualified_name)


def _traced(module: nn.Module) -> fx.Graph | None:
    """``module``'s forward as a torch.fx graph, or None when it does not trace."""
    if isinstance(module, torch.jit.ScriptModule):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = _Tracer().trace(module)
    except Exception:  # untraceable forwards fail in many ways; they are searched by child
        return None
    graph.owning_module = module
    return graph


def _graph_pairs(graph: fx.Graph) -> list[tuple[str, str]]:
    """(convolution, batch norm) call targets in ``graph`` where the norm is the only
    reader of the convolution's output, and each module is called once."""
    module = graph.owning_module
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or type(module.get_submodule(node.target)) is not nn.Conv2d:
            continue
        if len(node.users) != 1:
            continue
        (user,) = node.users
        if (
            user.op == "call_module"
            and user.args == (node,)
            and not user.kwargs
            and is_foldable_norm(module.get_submodule(user.target))
            and calls[node.target] == calls[user.target] == 1
        ):
            pairs.append((node.target, user.target))
    return pairs


def _replace(module: nn.Module, name: str, replacement: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent), child, replacement)


def folded(conv: nn.Conv2d, norm: nn.Module) -> nn.Conv2d:
    """A copy of ``conv`` with ``norm`` folded in, its weight channels_last."""
    weight, bias = fold_norm(conv, norm)
    result = copy.deepcopy(conv)
    result.weight = nn.Parameter(weight.contiguous(memory_format=torch.channels_last), False)
    result.bias = nn.Parameter(bias, False)
    return result


_CONV2D = torch.ops.aten.conv2d.default
_BATCH_NORM = torch.ops.aten.batch_norm.default


def exported_pairs(module: nn.Module) -> list[tuple[fx.Node, fx.Node]]:
    """(conv2d, batch_norm) ATen calls in a graph module's own graph (a torch.export
    program's) where an inference batch norm is the only reader of the convolution's
    output, and every weight they use is an attribute of the module that nothing else
    reads."""
    if not isinstance(module, fx.GraphModule):
        return []
    pairs = []
    for conv in module.graph.nodes:
        if conv.target is not _CONV2D or len(conv.users) != 1 or "bias" in conv.kwargs:
            continue
        (norm,) = conv.users
        if norm.target is not _BATCH_NORM or norm.kwargs or norm.args[0] is not conv:
            continue
        _, norm_weight, norm_bias, mean, var, training = norm.args[:6]
        if training:
            continue
        optional = [*conv.args[2:3], norm_weight, norm_bias]  # a bias or an affine map
        required = [conv.args[1], mean, var]
        if all(map(_own_attribute, required)) and all(
            _own_attribute(each) for each in optional if each is not None
        ):
            pairs.append((conv, norm))
    return pairs


def _own_attribute(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr" and len(node.users) == 1


def fold_exported(module: nn.Module) -> int:
    """Fold each of ``exported_pairs(module)`` in place; how many were folded."""
    pairs = exported_pairs(module)
    graph = module.graph if pairs else None
    for index, (conv, norm) in enumerate(pairs):
        conv_weights = (conv.args[1], conv.args[2] if len(conv.args) > 2 else None)
        weights = [_attribute(module, each) for each in (*conv_weights, *norm.args[1:5])]
        weight, bias = fold_affine(*weights, eps=norm.args[7])
        names = (f"_folded_{index}_weight", f"_folded_{index}_bias")
        module.register_buffer(names[0], weight.contiguous(memory_format=torch.channels_last))
        module.register_buffer(names[1], bias)
        with graph.inserting_before(conv):
            folded_args = tuple(graph.get_attr(name) for name in names)
        conv.args = (conv.args[0], *folded_args, *conv.args[3:])
        norm.replace_all_uses_with(conv)
        graph.erase_node(norm)
    if pairs:
        _drop_unread_attributes(module)
    return len(pairs)


def _attribute(module: nn.Module, node) -> torch.Tensor | None:
    if node is None:
        return None
    owner, _, name = node.target.rpartition(".")
    return getattr(module.get_submodule(owner), name)


def _drop_unread_attributes(module: fx.GraphModule) -> None:
    """Remove the get_attr calls nothing reads and the weights they read: the
    convolutions' and batch norms' own, now folded."""
    graph = module.graph
    unread = [n for n in graph.nodes if n.op == "get_attr" and not n.users]
    for node in unread:
        graph.erase_node(node)
    read = {n.target for n in graph.nodes if n.op == "get_attr"}
    for node in unread:
        if node.target not in read:
            parent, _, name = node.target.rpartition(".")
            owner = module.get_submodule(parent)
            if name in owner._parameters:
                del owner._parameters[name]
            else:
                owner._buffers.pop(name, None)
    module.recompile()
