"""winograd: 3x3 stride-1 convolutions as NNPACK Winograd F(6x6, 3x3), where faster (CPU).

Three quarters of a RetinaNet's FLOPs are 3x3 stride-1 convolutions. Winograd
F(6x6, 3x3) computes them with about 5x fewer multiplications (float32 error about 1e-5
relative); NNPACK, built into PyTorch's CPU library, implements it. PyTorch's own entry
point (``torch._nnpack_spatial_convolution``) transforms the kernel again on every call
(16.8 MB for a 256->256 kernel), which makes it no faster than oneDNN at 30x40 pixels
and slower below. Here the kernel is transformed once, per process, and every call
reuses it, through NNPACK's C API (``nnp_convolution_inference``, exported by
libtorch_cpu) with the bias and a following ReLU fused.

The pass times oneDNN against NNPACK on each convolution's real input sizes (from the
test data) and switches only the (convolution, input size) pairs that NNPACK runs
clearly faster (``MIN_GAIN``, ``MIN_SAVING_MS``); the engine then times the whole
model. Batch norms after a switched convolution are folded into it. The convolution
runs as the operator ``torch.ops.bladesmith_winograd.conv3x3``, so TorchScript traces
and freezes it; when compiling (Inductor, ``torch.export``) or exporting to ONNX the
module is a plain convolution again.

NNPACK runs on its own thread pool, beside PyTorch's OpenMP threads: a kernel that
starts while OpenMP's threads still spin after a parallel region (GNU OpenMP spins for
about 3 ms by default) shares the cores with them. ``GOMP_SPINCOUNT=30000`` in the
environment before torch loads shortens that spin (``GOMP_SPINCOUNT=0`` would make
oneDNN's own convolutions slower); the ``bladesmith`` command sets it unless it is set.
"""

from __future__ import annotations

import copy
import ctypes
import statistics
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bladesmith.models.convs import is_same_size_3x3
from bladesmith.passes.candidate import Candidate
from bladesmith.passes.registry import Context, Pass, PassSkipped, register

# NNPACK's enums (nnpack.h).
_WT8X8, _PRECOMPUTE, _REUSE = 3, 2, 3
# NNPACK must run a convolution alone this much faster than oneDNN, and save this much
# per call, to be used: in the model it also pays for sharing the cores with OpenMP's
# threads when it follows an OpenMP operator (GNU OpenMP's threads spin for several ms
# after a parallel region by default), and for reading its transformed kernels, 64
# values per 3x3 kernel instead of 9, from memory rather than cache. On RetinaNet
# R50-FPN (2 Zen 4 cores) using NNPACK at 60x80 and 30x40 with 256 channels (1.7-3x
# faster alone) beat using it also where it was 1.2-1.4x faster alone (15x20, 120x160).
MIN_GAIN = 1.5
MIN_SAVING_MS = 1.0
_ROUNDS = 5


class _Size(ctypes.Structure):
    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class _Padding(ctypes.Structure):
    _fields_ = [(side, ctypes.c_size_t) for side in ("top", "right", "bottom", "left")]


class _Nnpack:
    """NNPACK's inference entry point in libtorch_cpu, with a thread pool of its own."""

    def __init__(self):
        suffix = ".dylib" if sys.platform == "darwin" else ".so"
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / f"libtorch_cpu{suffix}"))
        self.inference = library.nnp_convolution_inference
        self.inference.restype = ctypes.c_int
        self.inference.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
            _Size, _Padding, _Size, _Size,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_size_t), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p,
        ]  # fmt: skip
        if library.nnp_initialize() != 0:
            raise OSError("nnp_initialize failed (NNPACK does not support this CPU)")
        library.pthreadpool_create.restype = ctypes.c_void_p
        library.pthreadpool_create.argtypes = [ctypes.c_size_t]
        self.pool = library.pthreadpool_create(torch.get_num_threads())

    def __call__(self, strategy, weight_shape, height, width, relu, buffers, workspace_size):
        """nnp_convolution_inference; buffers: input, kernel, bias, output, workspace."""
        out_channels, in_channels = weight_shape[:2]
        status = self.inference(
            _WT8X8, strategy, in_channels, out_channels,
            _Size(width, height), _Padding(1, 1, 1, 1), _Size(3, 3), _Size(1, 1),
            *[None if b is None else ctypes.c_void_p(b.data_ptr()) for b in buffers],
            ctypes.byref(workspace_size), int(relu), None, self.pool, None,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"nnp_convolution_inference failed with NNPACK status {status}")


_nnpack: _Nnpack | None = None
_nnpack_error: str | None = None


def unavailable() -> str | None:
    """Why NNPACK cannot run here, or None when it can (loads it on first use)."""
    global _nnpack, _nnpack_error
    if _nnpack is None and _nnpack_error is None:
        if not torch.backends.nnpack.is_available():
            _nnpack_error = "this PyTorch build has no NNPACK"
        else:
            try:
                _nnpack = _Nnpack()
            except (OSError, AttributeError) as error:  # no library, or no such symbol
                _nnpack_error = f"NNPACK's C API is not reachable in libtorch_cpu: {error}"
    return _nnpack_error


def _loaded() -> _Nnpack:
    reason = unavailable()
    if reason:
        raise RuntimeError(f"bladesmith_winograd::conv3x3: {reason}")
    return _nnpack


# Transformed kernels by weight tensor, made in this process: their layout follows this
# CPU's cache sizes, so they are never saved with the model. An entry goes with its
# weight, and is made again when the weight is changed in place.
_kernels: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
_workspaces = threading.local()


def _transformed_kernel(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)
    entry = _kernels.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == weight._version:
        return entry[2]
    nnpack, size = _loaded(), ctypes.c_size_t(0)
    # The transform does not depend on the image size: any size will do.
    nnpack(_PRECOMPUTE, weight.shape, 8, 8, False, [None] * 5, size)  # asks for the size
    kernel = torch.empty(size.value, dtype=torch.uint8)
    weights = weight.detach().contiguous()
    nnpack(_PRECOMPUTE, weight.shape, 8, 8, False, [None, weights, None, None, kernel], size)
    if entry is None:
        weakref.finalize(weight, _kernels.pop, key, None)
    _kernels[key] = (weakref.ref(weight), weight._version, kernel)
    return kernel


def _conv3x3(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, relu: bool):
    if not x.dtype == weight.dtype == bias.dtype == torch.float32:
        raise TypeError(f"bladesmith_winograd::conv3x3 computes in float32, got {x.dtype}")
    batch, _, height, width = x.shape
    x, bias = x.contiguous(), bias.contiguous()
    kernel = _transformed_kernel(weight)
    out = x.new_empty(batch, weight.shape[0], height, width)
    nnpack, size = _loaded(), ctypes.c_size_t(0)
    nnpack(_REUSE, weight.shape, height, width, relu, [None] * 5, size)  # workspace size
    workspace = getattr(_workspaces, "buffer", None)
    if workspace is None or workspace.numel() < size.value:
        workspace = _workspaces.buffer = torch.empty(size.value, dtype=torch.uint8)
    for i in range(batch):  # NNPACK's inference API takes one image
        size.value = workspace.numel()
        buffers = [x[i], kernel, bias, out[i], workspace]
        nnpack(_REUSE, weight.shape, height, width, relu, buffers, size)
    return out


_library = torch.library.Library("bladesmith_winograd", "DEF")
_library.define("conv3x3(Tensor x, Tensor weight, Tensor bias, bool relu) -> Tensor")
_library.impl("conv3x3", _conv3x3, "CPU")
_library.impl(
    "conv3x3",
    lambda x, weight, bias, relu: x.new_empty(x.shape[0], weight.shape[0], *x.shape[2:]),
    "Meta",
)


class WinogradConv2d(nn.Module):
    """A 3x3 stride-1 padding-1 convolution (+ ReLU) that runs NNPACK's Winograd on the
    input sizes in ``sizes``, and ``F.conv2d`` on other sizes and whenever it is compiled
    or exported (those see a plain convolution)."""

    def __init__(self, weight, bias, relu: bool, sizes):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", bias.detach().clone())
        self.relu = relu
        self.sizes = frozenset(sizes)

    def forward(self, x):
        if not _exporting() and x.dtype == torch.float32:
            # TorchScript's tracer makes shapes tensors: int() reads the value it records.
            if (int(x.shape[-2]), int(x.shape[-1])) in self.sizes:
                return torch.ops.bladesmith_winograd.conv3x3(x, self.weight, self.bias, self.relu)
        y = F.conv2d(x, self.weight, self.bias, 1, 1)
        return F.relu(y) if self.relu else y

    def extra_repr(self) -> str:
        sizes = ", ".join(f"{h}x{w}" for h, w in sorted(self.sizes))
        channels = f"{self.weight.shape[1]}, {self.weight.shape[0]}"
        return f"{channels}, relu={self.relu}, winograd at {sizes}"


def _exporting() -> bool:
    return torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()


def eligible(module: nn.Module) -> bool:
    """A float32 3x3 convolution, stride 1, padding 1, no dilation or groups."""
    return is_same_size_3x3(module) and module.weight.dtype == torch.float32


@register
class Winograd(Pass):
    """3x3 stride-1 convolutions as NNPACK Winograd with pre-transformed kernels (CPU)."""

    name = "winograd"
    devices = ("cpu",)

    def skip_reason(self, candidate: Candidate, context: Context) -> str | None:
        if isinstance(candidate.module, torch.jit.ScriptModule):
            return "TorchScript modules cannot be rewritten; give optimize the nn.Module"
        if candidate.dtype != torch.float32:
            return "NNPACK's Winograd computes in float32 only"
        if not any(eligible(m) for m in candidate.module.modules()):
            return "the model has no 3x3 stride-1 convolutions"
        return unavailable()

    def apply(self, candidate: Candidate, context: Context) -> Candidate:
        module = copy.deepcopy(candidate.module)
        with context.step("timing oneDNN against NNPACK per convolution"):
            sizes = _input_sizes(module, [candidate.runner_args(a) for a in context.test_args])
            timings = {key: _time(*key) for key in {_key(c, s) for c, ss in sizes for s in ss}}
        chosen = {
            conv: {s for s in conv_sizes if _wins(timings[_key(conv, s)])}
            for conv, conv_sizes in sizes
        }
        switched = _replace(module, {conv: s for conv, s in chosen.items() if s})
        if not switched:
            raise PassSkipped(f"oneDNN is faster on every 3x3 convolution: {_summary(timings)}")
        context.notes.append(
            f"winograd: {len(switched)} of {len(sizes)} 3x3 stride-1 convolutions run "
            f"NNPACK Winograd at some input size ({', '.join(switched)}); per call, "
            f"oneDNN -> NNPACK: {_summary(timings)}"
        )
        return candidate.with_module(module, self.name)


def _input_sizes(module: nn.Module, test_args: list[tuple]) -> list[tuple[nn.Conv2d, list]]:
    """Each eligible convolution with the input shapes it gets on the test data."""
    seen: dict[nn.Conv2d, list] = {}

    def record(conv, args):
        shape = tuple(args[0].shape)
        if args[0].dtype == torch.float32 and shape not in seen[conv]:
            seen[conv].append(shape)

    hooks = []
    for conv in module.modules():
        if eligible(conv):
            seen[conv] = []
            hooks.append(conv.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            for args in test_args:
                module(*args)
    finally:
        for hook in hooks:
            hook.remove()
    return [(conv, shapes) for conv, shapes in seen.items() if shapes]


def _key(conv: nn.Conv2d, shape: tuple) -> tuple:
    return (conv.out_channels, *shape)


def _time(out_channels: int, batch: int, channels: int, height: int, width: int):
    """Median ms per call of oneDNN and of NNPACK on random data of this shape: each
    runs four times in a row, of which the last two are timed (its threads awake, its
    kernel transformed, and OpenMP's threads done spinning, which takes longer than a
    30x40 call), the two in turn so that a burst of load elsewhere hits both."""
    x = torch.randn(batch, channels, height, width)
    weight = torch.randn(out_channels, channels, 3, 3) * (channels * 9) ** -0.5
    bias = torch.zeros(out_channels)
    runs = {
        "onednn": lambda: F.conv2d(x, weight, bias, 1, 1),
        "nnpack": lambda: torch.ops.bladesmith_winograd.conv3x3(x, weight, bias, False),
    }
    times = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(_ROUNDS):
            for name, run in runs.items():
                for call in range(4):
                    start = time.perf_counter()
                    run()
                    if call >= 2:
                        times[name].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times["onednn"]), statistics.median(times["nnpack"])


def _wins(timing: tuple[float, float]) -> bool:
    onednn, nnpack = timing
    return nnpack * MIN_GAIN <= onednn and onednn - nnpack >= MIN_SAVING_MS


def _summary(timings: dict) -> str:
    return ", ".join(
        f"{channels}->{out} at {h}x{w} {onednn:.2f} -> {nnpack:.2f} ms"
        + ("" if _wins((onednn, nnpack)) else " (kept oneDNN)")
        for (out, _, channels, h, w), (onednn, nnpack) in sorted(
            timings.items(), key=lambda item: -item[1][0]
        )
    )


def _replace(module: nn.Module, chosen: dict[nn.Conv2d, set]) -> list[str]:
    """Swap each chosen convolution for a WinogradConv2d; returns the names swapped.

    What follows the convolution is folded into it where the structure says what
    follows: in a Sequential, a batch norm and then a ReLU; in torchvision's ResNet
    blocks, ``bnN`` after ``convN`` (their forward applies them in that order)."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    swapped = []
    for parent_name, parent in list(module.named_modules()):
        children = dict(parent.named_children())
        names = list(children)
        for position, name in enumerate(names):
            conv = children[name]
            if conv not in chosen:
                continue
            if isinstance(parent, nn.Sequential):
                following = names[position + 1 : position + 3]
            elif isinstance(parent, (BasicBlock, Bottleneck)):
                following = [n for n in [name.replace("conv", "bn")] if n in children]
            else:
                following = []
            norm = children[following[0]] if following else None
            norm = norm if norm is not None and _is_norm(norm) else None
            rest = following[1:] if norm is not None else following
            relu = isinstance(parent, nn.Sequential) and bool(rest)
            relu = relu and isinstance(children[rest[0]], nn.ReLU)
            folded = following[: (norm is not None) + relu]
            weight, bias = _folded(conv, norm)
            sizes = {shape[-2:] for shape in chosen[conv]}
            setattr(parent, name, WinogradConv2d(weight, bias, relu, sizes))
            for other in folded:
                setattr(parent, other, nn.Identity())
            swapped.append(f"{parent_name}.{name}".lstrip("."))
    return swapped


def _is_norm(module: nn.Module) -> bool:
    from torchvision.ops import FrozenBatchNorm2d

    if isinstance(module, nn.BatchNorm2d):
        return not module.training and module.track_running_stats
    return isinstance(module, FrozenBatchNorm2d)


def _folded(conv: nn.Conv2d, norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    weight = conv.weight.detach()
    bias = conv.bias.detach() if conv.bias is not None else torch.zeros(conv.out_channels)
    if norm is None:
        return weight, bias
    scale = norm.weight / torch.sqrt(norm.running_var + norm.eps)
    return weight * scale.view(-1, 1, 1, 1), (bias - norm.running_mean) * scale + norm.bias
