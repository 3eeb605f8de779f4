"""What a served artifact takes and returns, per request row, and how rows are run.

A saved artifact is optimized for fixed shapes, batch included: that batch is the
largest bucket. The powers of two below it are smaller buckets where the artifact runs
at them and answers as it does at its own batch (a TorchScript file often does; an
AOTInductor package or an ONNX file with a fixed batch does not). Requests are stacked
and cut into full buckets of the largest; the rows left over run in the smallest bucket
that holds them, padded with zeros; each request gets back its own rows. A model of a
family (a detector) is served in the family's padded form (``Family.output_names``:
boxes, scores, labels, num_detections), one fixed shape whatever it finds.
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
from bladesmith.serve.answers import comparison
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


class BadRequest(str):
    """Why a request was refused for what it holds (the client's error, HTTP 400), as
    against the model failing on it."""


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
    """Runs requests through one loaded artifact, in buckets (``buckets``: the batch
    sizes it runs at, the artifact's own the largest). One per model instance. Each
    bucket has its own staging buffers; on a GPU its call is replayed from its own CUDA
    graph, whose static buffers belong to this runner alone. Calls are serialised (a
    lock) around them."""

    def __init__(self, module, signature: Signature | None = None, image_dtype: str = "float32"):
        self.signature = signature or signature_of(module, image_dtype)
        self.device = module.device
        self.run = module_runner(module)
        if self.device.type == "cuda":
            self.run = _graphed(self.run, self.device, self.signature)
        self._lock = threading.Lock()
        # Per bucket, one buffer of each input, filled in place by each call (pinned on
        # a GPU, so that the copy to it is one transfer); the lock keeps calls from
        # sharing them.
        self._staging = {self.signature.bucket: self._new_staging(self.signature.bucket)}
        dropped = self._add_smaller_buckets(module)
        print(f"bladesmith serve: {_buckets_said(self.buckets, dropped)}", file=sys.stderr)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._staging))

    def answer(self, requests: list[list[np.ndarray]]) -> list[dict[str, np.ndarray] | str]:
        """For each request (its input arrays, rows first): its outputs by name, or the
        reason it was refused. A refused request does not fail the others."""
        answers: list = [self.signature.check(arrays) for arrays in requests]
        answers = [BadRequest(error) if error else None for error in answers]
        good = [i for i, error in enumerate(answers) if error is None]
        if not good:
            return answers
        rows = [requests[i][0].shape[0] for i in good]
        try:
            outputs = self._run_rows([requests[i] for i in good])
        except Exception as error:  # noqa: BLE001 - the client gets the reason, the server lives
            message = f"the model failed: {_reason(error)}"
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
        """The requests' rows, in order, run in full buckets of the largest size, and the
        rows left over in the smallest bucket that holds them."""
        pieces = []
        for blocks in _buckets(requests, self.signature.bucket):
            rows = sum(block[0].shape[0] for block in blocks)
            size = min(size for size in self._staging if size >= rows)
            with self._lock:
                pieces.append(self._run_bucket(size, blocks))
        outputs = [np.concatenate(column) for column in zip(*pieces)]
        return [
            output.reshape(-1, 1) if spec.scalar else output
            for spec, output in zip(self.signature.outputs, outputs)
        ]

    def _run_bucket(self, size: int, blocks: list[list[np.ndarray]]) -> list[np.ndarray]:
        """Blocks of rows copied into bucket ``size``'s staging buffers (the rest zeroed)
        and run; the outputs' filled rows."""
        staging = self._staging[size]
        filled = _stage(staging, blocks)
        flat = _flat_outputs(self.run, staging, self.device)
        for spec, value in zip(self.signature.outputs, flat):
            if value.shape[:1] != (size,):
                raise BladesmithError(
                    f"output {spec.name!r} has shape {list(value.shape)} at batch {size}"
                )
        # An output may view the staging buffers (a reshape of the input, on a CPU):
        # copied before the next call overwrites them.
        staged = [buffer.numpy() for buffer in staging]
        return [_own(value[:filled], staged) for value in flat]

    def _new_staging(self, size: int) -> list[torch.Tensor]:
        staging = [
            torch.from_numpy(np.zeros((size, *spec.dims), spec.dtype))
            for spec in self.signature.inputs
        ]
        return (
            [buffer.pin_memory() for buffer in staging] if self.device.type == "cuda" else staging
        )

    def _add_smaller_buckets(self, module) -> dict[int, str]:
        """Keep each power of two below the artifact's batch where the artifact runs and
        answers seeded random rows (a detector's: views of photographs) as it answers
        them in the first slots of its own batch (within the rounding of the dtype it
        computes in); why each other one was not."""
        full = self.signature.bucket
        sizes, fixed = smaller_buckets(full), _only_at_its_batch(module)
        if fixed or not sizes:
            return dict.fromkeys(sizes, fixed)
        generator = np.random.default_rng(0)
        rows = [
            random_rows(generator, spec.dtype, (full, *spec.dims), self.signature.detections)
            for spec in self.signature.inputs
        ]
        reference = self._answer_rows(rows)
        # The same rows in reverse order: what another slot alone changes, excused for a
        # detector as the load test excuses it.
        in_reverse = self._answer_rows([array[::-1] for array in rows])
        variant = {name: value[::-1] for name, value in in_reverse.items()}
        same = comparison(module.spec.dtype)

        def why_not(size: int) -> str | None:
            try:
                answer = self._answer_rows([array[:size] for array in rows])
            except Exception as error:  # noqa: BLE001 - it does not run at this batch
                return _reason(error)
            if same(answer, _head(reference, size), [_head(variant, size)]):
                return None
            return f"answers differ from batch {full}'s"

        dropped = {}
        for size in sizes:
            self._staging[size] = self._new_staging(size)
            why = why_not(size)
            if why is not None:
                dropped[size] = why
                del self._staging[size]
        return dropped

    def _answer_rows(self, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
        """One request's outputs by name, run as any request's are."""
        outputs = self._run_rows([rows])
        return {spec.name: output for spec, output in zip(self.signature.outputs, outputs)}


def smaller_buckets(batch: int) -> list[int]:
    """The powers of two below ``batch``, in increasing order."""
    return [1 << k for k in range(batch.bit_length()) if 1 << k < batch]


def random_rows(
    generator: np.random.Generator, dtype: np.dtype, shape, photos: bool = False
) -> np.ndarray:
    """Random rows of a served input, like images: uint8 in [0, 255], else float32 in
    [0, 1). With ``photos`` (a detector's images, [N, 3, H, W]), N distinct views of
    real photographs (``varied_photos``): a detector answers random pixels with nearly
    the same detections whatever they are, so one row's answer could pass for another's."""
    if photos and len(shape) == 4 and shape[1] == 3:
        from bladesmith.models.images import varied_photos

        seed = int(generator.integers(2**31))
        rows = varied_photos(shape[0], tuple(shape[2:]), seed).numpy()
        return np.rint(rows * 255).astype(np.uint8) if dtype == np.uint8 else rows
    if dtype == np.uint8:
        return generator.integers(0, 256, shape, dtype=np.uint8)
    return generator.random(shape, dtype=np.float32)


def _only_at_its_batch(module) -> str | None:
    """Why the artifact is not tried at other batches, or None."""
    if getattr(module, "batch_fixed", False):
        return "the artifact runs at its own batch only"
    return None


def _head(answer: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    return {name: value[:rows] for name, value in answer.items()}


def _buckets_said(buckets: tuple[int, ...], dropped: dict[int, str]) -> str:
    """One line: the buckets served, and for those dropped, why (alike reasons once)."""
    said = f"batch buckets {', '.join(map(str, buckets))}"
    reasons: dict[str, list[int]] = {}
    for size, why in dropped.items():
        reasons.setdefault(why, []).append(size)
    for why, sizes in reasons.items():
        said += f"; not {', '.join(map(str, sizes))}: {why}"
    return said


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]


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


def _stage(staging: list[torch.Tensor], blocks: list[list[np.ndarray]]) -> int:
    """Copy blocks of rows (per block, one array per input) into a bucket's staging
    buffers, zeroing the rest; returns the rows filled."""
    filled = 0
    for block in blocks:
        count = block[0].shape[0]
        for buffer, array in zip(staging, block):
            buffer.numpy()[filled : filled + count] = array
        filled += count
    for buffer in staging:
        buffer.numpy()[filled:] = 0
    return filled


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
        print(
            f"bladesmith serve: no CUDA graph for this artifact ({_reason(error)})", file=sys.stderr
        )
        return run
    return graphed


def _to_numpy(value) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        raise BladesmithError(f"serve: the artifact returns a {type(value).__name__}, not tensors")
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16
        value = value.float()
    return value.numpy()
