"""What a served artifact takes and returns, per request row, and how rows are run.

A saved artifact is fixed to the shapes it was optimized for, batch included: that batch
is the bucket. Requests are stacked, cut into buckets, the last one padded with zeros,
run, and each request gets back its own rows. A model of a family (a detector) is served
in the family's padded form (``Family.output_names``: boxes, scores, labels,
num_detections), one fixed shape whatever it finds.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils import _pytree as pytree

from bladesmith.errors import BladesmithError
from bladesmith.families.base import DetectionFamily
from bladesmith.spec import OUTPUT_AS_MODEL

FAMILY_INPUT = "images"  # a family's pipeline takes one batch of images
# The served inputs are float32 images/features: bladesmith's spec records input shapes
# (the fast path's), and every artifact it writes takes float32 there.
INPUT_DTYPE = np.dtype(np.float32)
# A detector's images may be served as uint8 (a quarter of the bytes to send, copy and
# transfer), made float32 in [0, 1] (x / 255) on the model's device.
IMAGE_DTYPES = {"float32": INPUT_DTYPE, "uint8": np.dtype(np.uint8)}
TRITON_DTYPES = {
    np.dtype(np.float32): "FP32",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float64): "FP64",
    np.dtype(np.int64): "INT64",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int8): "INT8",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.bool_): "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype
    dims: tuple[int, ...]  # one row's shape, as served (a per-row scalar is served as [1])
    scalar: bool = False  # the model gives one value per row: [B], served as [B, 1]

    @property
    def triton_dtype(self) -> str:
        return TRITON_DTYPES[self.dtype]


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    bucket: int  # the batch the artifact was built for
    detections: bool  # a detection family's padded outputs

    def check(self, arrays: list[np.ndarray]) -> str | None:
        """Why one request's inputs cannot be run, or None. The server checks names,
        dtypes and shapes too; this also catches empty batches and non-finite values."""
        if len(arrays) != len(self.inputs):
            return f"expected {len(self.inputs)} inputs, got {len(arrays)}"
        rows = {array.shape[0] if array.ndim else None for array in arrays}
        if len(rows) != 1:
            return f"inputs disagree on the batch size: {sorted(map(str, rows))}"
        for spec, array in zip(self.inputs, arrays):
            if array.dtype != spec.dtype:
                return f"input {spec.name!r}: expected {spec.triton_dtype}, got {array.dtype}"
            if tuple(array.shape[1:]) != spec.dims:
                expected = ", ".join(map(str, ("N", *spec.dims)))
                return f"input {spec.name!r}: expected shape [{expected}], got {list(array.shape)}"
            if array.shape[0] == 0:
                return f"input {spec.name!r} is empty (batch of 0 rows)"
            if np.issubdtype(array.dtype, np.floating) and not _all_finite(array):
                return f"input {spec.name!r} has non-finite values (NaN or infinity)"
        return None


def signature_of(module, image_dtype: str = "float32") -> Signature:
    """The served signature of a loaded artifact (``bladesmith.load``), found by running
    it once on zeros of the shapes it was built for; a detector's images served as
    ``image_dtype`` (float32, or uint8 scaled by 1/255 on the device)."""
    spec = module.spec
    shapes = spec.input_shapes
    if not shapes or any(len(shape) == 0 for shape in shapes):
        raise BladesmithError("serve: the artifact's inputs have no batch dimension")
    bucket = shapes[0][0]
    if any(shape[0] != bucket for shape in shapes):
        raise BladesmithError(
            f"serve: the artifact's inputs disagree on the batch dimension: {list(shapes)}"
        )
    family = module.family
    if image_dtype not in IMAGE_DTYPES:
        raise BladesmithError(f"--image-dtype: expected float32 or uint8, got {image_dtype!r}")
    if family is not None:
        names = (FAMILY_INPUT,)
    elif image_dtype != "float32":
        raise BladesmithError(
            f"--image-dtype {image_dtype}: only a detector's images can be served so; "
            "this artifact takes features (leave --image-dtype out)"
        )
    else:
        names = tuple(f"input_{i}" for i in range(len(shapes)))
    dtype = IMAGE_DTYPES[image_dtype]
    inputs = tuple(TensorSpec(n, dtype, tuple(s[1:])) for n, s in zip(names, shapes))
    zeros = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
    flat = _flat_outputs(module_runner(module), zeros, module.device)
    names = family.output_names if family else [f"output_{i}" for i in range(len(flat))]
    outputs = []
    for name, value in zip(names, flat):
        if value.ndim == 0 or value.shape[0] != bucket:
            raise BladesmithError(
                f"serve: output {name!r} has shape {list(value.shape)}, not one row per "
                f"input row (batch {bucket}); only batch-parallel outputs can be served"
            )
        scalar = value.ndim == 1
        outputs.append(TensorSpec(name, value.dtype, (1,) if scalar else value.shape[1:], scalar))
    if spec.output == OUTPUT_AS_MODEL and not flat:
        raise BladesmithError("serve: the artifact returns no tensor")
    detections = isinstance(family, DetectionFamily)
    return Signature(inputs, tuple(outputs), bucket, detections)


def module_runner(module):
    """The call that gives a loaded artifact's outputs as tensors (a family's: padded)."""
    return module.as_padded() if module.family is not None else module


class BucketRunner:
    """Runs requests through one loaded artifact, in buckets of its batch size. One per
    model instance. On a GPU the bucket's call is replayed from a CUDA graph whose static
    buffers belong to this runner alone; calls are serialised (a lock) around them."""

    def __init__(self, module, signature: Signature | None = None, image_dtype: str = "float32"):
        self.signature = signature or signature_of(module, image_dtype)
        self.device = module.device
        self.run = module_runner(module)
        if self.device.type == "cuda":
            self.run = _graphed(self.run, self.device, self.signature)
        # One bucket of each input, filled in place by each call (pinned on a GPU, so
        # that the copy to it is one transfer); the lock keeps calls from sharing it.
        pinned = self.device.type == "cuda"
        self._staging = [
            torch.from_numpy(np.zeros((self.signature.bucket, *spec.dims), spec.dtype))
            for spec in self.signature.inputs
        ]
        if pinned:
            self._staging = [staging.pin_memory() for staging in self._staging]
        self._lock = threading.Lock()

    def answer(self, requests: list[list[np.ndarray]]) -> list[dict[str, np.ndarray] | str]:
        """For each request (its input arrays, rows first): its outputs by name, or the
        reason it was refused. A refused request does not fail the others."""
        answers: list = [self.signature.check(arrays) for arrays in requests]
        good = [i for i, error in enumerate(answers) if error is None]
        if not good:
            return answers
        rows = [requests[i][0].shape[0] for i in good]
        try:
            outputs = self._run_rows([requests[i] for i in good])
        except Exception as error:  # noqa: BLE001 - the client gets the reason, the server lives
            message = f"the model failed: {type(error).__name__}: {error}".splitlines()[0]
            for i in good:
                answers[i] = message
            return answers
        start = 0
        for i, count in zip(good, rows):
            answers[i] = {
                spec.name: output[start : start + count]
                for spec, output in zip(self.signature.outputs, outputs)
            }
            start += count
        return answers

    def _run_rows(self, requests: list[list[np.ndarray]]) -> list[np.ndarray]:
        """The requests' rows, in order, run a bucket at a time: each bucket's rows are
        copied into the staging buffers (the rest zeroed) and run."""
        pieces = []
        staged = [staging.numpy() for staging in self._staging]
        for bucket in _buckets(requests, self.signature.bucket):
            with self._lock:
                filled = self._stage(bucket)
                flat = [
                    value[:filled] for value in _flat_outputs(self.run, self._staging, self.device)
                ]
                # An output may view the staging buffers (a reshape of the input, on a
                # CPU): copied before the next bucket overwrites them.
                pieces.append([_own(value, staged) for value in flat])
        outputs = [np.concatenate(column) for column in zip(*pieces)]
        return [
            output.reshape(-1, 1) if spec.scalar else output
            for spec, output in zip(self.signature.outputs, outputs)
        ]

    def _stage(self, bucket: list[list[np.ndarray]]) -> int:
        """Copy one bucket's row blocks (per block, one array per input) into the staging
        buffers; returns the rows filled."""
        filled = 0
        for block in bucket:
            count = block[0].shape[0]
            for staging, array in zip(self._staging, block):
                staging.numpy()[filled : filled + count] = array
            filled += count
        for staging in self._staging:
            staging.numpy()[filled:] = 0
        return filled


def _buckets(requests: list[list[np.ndarray]], size: int):
    """The requests' rows in buckets of at most ``size``: per bucket, blocks of rows
    (one array per input) cut from the requests in order."""
    bucket, room = [], size
    for arrays in requests:
        start, total = 0, arrays[0].shape[0]
        while start < total:
            take = min(room, total - start)
            bucket.append([array[start : start + take] for array in arrays])
            start, room = start + take, room - take
            if room == 0:
                yield bucket
                bucket, room = [], size
    if bucket:
        yield bucket


def _own(value: np.ndarray, buffers: list[np.ndarray]) -> np.ndarray:
    """``value``, copied if it shares memory with one of ``buffers``."""
    return value.copy() if any(np.may_share_memory(value, b) for b in buffers) else value


def _all_finite(array: np.ndarray) -> bool:
    # A sum is finite when every value is, unless it overflows: then look at each.
    return bool(np.isfinite(array.sum())) or bool(np.isfinite(array).all())


def _flat_outputs(run, tensors: list[torch.Tensor], device) -> list[np.ndarray]:
    if device.type == "cuda":  # a graph's inputs live on its device
        tensors = [t.to(device, non_blocking=True) for t in tensors]
    tensors = [t.float().div_(255) if t.dtype == torch.uint8 else t for t in tensors]
    with torch.no_grad():
        outputs = run(*tensors)
    return [_to_numpy(value) for value in pytree.tree_leaves(outputs)]


def _graphed(run, device: torch.device, signature: Signature):
    """``run`` replayed from a CUDA graph captured now on a zero bucket, or ``run`` itself
    where the artifact cannot be captured (said on stderr: the server still serves)."""
    from bladesmith.runtimes.cuda_graph import CudaGraphRunner

    graphed = CudaGraphRunner(run, device)
    zeros = [
        torch.zeros((signature.bucket, *spec.dims), dtype=torch.float32, device=device)
        for spec in signature.inputs
    ]
    try:
        with torch.no_grad():
            graphed(*zeros)
    except RuntimeError as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"bladesmith serve: no CUDA graph for this artifact ({reason})", file=sys.stderr)
        return run
    return graphed


def _to_numpy(value) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        raise BladesmithError(f"serve: the artifact returns a {type(value).__name__}, not tensors")
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16
        value = value.float()
    return value.numpy()
