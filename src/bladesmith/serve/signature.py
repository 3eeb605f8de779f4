"""What a served artifact takes and returns, per request row, and how rows are run.

A saved artifact is optimized for fixed shapes, batch included: that batch is the
largest bucket. The powers of two below it are smaller buckets where the artifact runs
at them and answers as it does at its own batch (a TorchScript file often does; an
AOTInductor package or an ONNX file with a fixed batch does not). Requests are stacked
and cut into full buckets of the largest; the rows left over run in the smallest bucket
that holds them, padded (zeros; an integer input's lowest value); each request gets back
its own rows. A model of a family (a detector) is served in the family's padded form
(``Family.output_names``: boxes, scores, labels, num_detections), one fixed shape
whatever it finds. Each input is served in the dtype the artifact records (token ids as
int64, say), a detector's images as float32 or uint8.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils import _pytree as pytree

from bladesmith._files import first_line
from bladesmith.errors import BladesmithError
from bladesmith.families.base import DetectionFamily
from bladesmith.serve.answers import comparison
from bladesmith.spec import OUTPUT_AS_MODEL

FAMILY_INPUT = "images"  # a family's pipeline takes one batch of images
# A detector's images may be served as uint8 (a quarter of the bytes to send, copy and
# transfer), made float32 in [0, 1] (x / 255) on the model's device.
IMAGE_DTYPES = {"float32": np.dtype(np.float32), "uint8": np.dtype(np.uint8)}
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
NUMPY_DTYPES = {triton: dtype for dtype, triton in TRITON_DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype
    dims: tuple[int, ...]  # one row's shape, as served (a per-row scalar is served as [1])
    scalar: bool = False  # one value per row: [B] to the model, served as [B, 1]
    # An integer input's lowest and highest value in the artifact's test data: its test
    # rows' (a token id drawn past them could index nothing).
    values: tuple[int, int] | None = None

    @property
    def triton_dtype(self) -> str:
        return TRITON_DTYPES[self.dtype]

    @property
    def model_dims(self) -> tuple[int, ...]:
        """One row's shape as the model has it."""
        return () if self.scalar else self.dims

    @property
    def fill(self) -> int:
        """What rows that hold no request's hold (padding; the first run): 0, or an
        integer input's lowest value in the test data (a length or an id of 0 may index
        nothing)."""
        return self.values[0] if self.values is not None else 0


class BadRequest(str):
    """Why a request was refused for what it holds (the client's error, HTTP 400), as
    against the model failing on it."""


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    bucket: int  # the batch the artifact was built for
    detections: bool  # a detection family's padded outputs
    uint8_images: bool = False  # a detector's images served as uint8, run as float32 / 255

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
    it once on rows of the shapes and dtypes it was built for (``TensorSpec.fill``); a
    detector's images served as ``image_dtype`` (float32, or uint8 scaled by 1/255 on the
    device)."""
    spec = module.spec
    shapes = spec.input_shapes
    if not shapes or any(len(shape) == 0 for shape in shapes):
        raise BladesmithError("serve: the artifact's inputs have no batch dimension")
    if any(shape[0] != shapes[0][0] for shape in shapes):
        raise BladesmithError(
            f"serve: the artifact's inputs disagree on the batch dimension: {list(shapes)}"
        )
    bucket = max(getattr(module, "batches", ()), default=shapes[0][0])  # a .pt2's largest
    family = module.family
    if image_dtype not in IMAGE_DTYPES:
        raise BladesmithError(f"--image-dtype: expected float32 or uint8, got {image_dtype!r}")
    if family is None and image_dtype != "float32":
        raise BladesmithError(
            f"--image-dtype {image_dtype}: only a detector's images can be served so; "
            "this artifact takes features (leave --image-dtype out)"
        )
    if family is not None:
        inputs = (TensorSpec(FAMILY_INPUT, IMAGE_DTYPES[image_dtype], tuple(shapes[0][1:])),)
    else:
        inputs = _recorded_inputs(spec)
    uint8_images = family is not None and image_dtype == "uint8"
    filled = _filled(inputs, bucket, uint8_images, module.device)
    try:
        with torch.no_grad():
            answer = module_runner(module)(*filled)
    except Exception as error:  # the model's own failure: one line, with what it was given
        given = ", ".join(
            f"{tensor.name} {str(x.dtype).removeprefix('torch.')} {list(x.shape)}"
            for tensor, x in zip(inputs, filled)
        )
        older = (
            ""
            if spec.input_dtypes or family is not None
            else "; it records no input dtypes (saved by an earlier bladesmith): save it again"
        )
        raise BladesmithError(
            f"serve: the artifact fails on inputs {given}: {first_line(error)}{older}"
        ) from error
    flat = _numpy_leaves(answer)
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
    return Signature(inputs, tuple(outputs), bucket, detections, uint8_images)


def _recorded_inputs(spec) -> tuple[TensorSpec, ...]:
    """The artifact's inputs as it records them: ``input_N``, of its dtypes (float32 for
    an artifact saved before they were recorded: what it was served as then), an integer
    input with the range of its test data."""
    dtypes = spec.input_dtypes or ("float32",) * len(spec.input_shapes)
    ranges = dict(enumerate(spec.input_ranges))
    inputs = []
    for i, (shape, name) in enumerate(zip(spec.input_shapes, dtypes)):
        try:
            dtype = np.dtype(name)
        except TypeError:  # bfloat16, float8: numpy has none
            dtype = None
        if dtype not in TRITON_DTYPES:
            raise BladesmithError(
                f"serve: input_{i} is {name}, which cannot be served (Triton and numpy "
                f"share {', '.join(sorted(map(str, TRITON_DTYPES)))}): optimize the model "
                "for inputs of one of those"
            )
        scalar = len(shape) == 1  # served as [1] (Triton batches rows of at least one value)
        dims = (1,) if scalar else tuple(shape[1:])
        inputs.append(TensorSpec(f"input_{i}", dtype, dims, scalar, ranges.get(i)))
    return tuple(inputs)


def _filled(inputs, rows: int, uint8_images: bool, device=None) -> list[torch.Tensor]:
    """``rows`` rows of each input, holding its ``fill``, as the model takes them (a
    detector's uint8 images: float32)."""
    filled = []
    for spec in inputs:
        dtype = np.dtype(np.float32) if uint8_images else spec.dtype
        torch_dtype = torch.from_numpy(np.zeros(0, dtype)).dtype
        shape = (rows, *spec.model_dims)
        filled.append(torch.full(shape, spec.fill, dtype=torch_dtype, device=device))
    return filled


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
        """Blocks of rows copied into bucket ``size``'s staging buffers (the rest padding)
        and run; the outputs' filled rows."""
        staging = self._staging[size]
        filled = _stage(staging, blocks, self.signature.inputs)
        flat = _flat_outputs(self.run, staging, self.device, self.signature.uint8_images)
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
            torch.from_numpy(np.zeros((size, *spec.model_dims), spec.dtype))
            for spec in self.signature.inputs
        ]
        return (
            [buffer.pin_memory() for buffer in staging] if self.device.type == "cuda" else staging
        )

    def _add_smaller_buckets(self, module) -> dict[int, str]:
        """Keep each power of two below the artifact's batch (a .pt2's: each batch below
        it that it holds a model for) where the artifact runs and answers alike. Alike:
        seeded random rows (a detector's: views of photographs) answered there as in the
        first slots of its own batch, within the rounding of the dtype it computes in.
        Returns why each other one was not kept."""
        full = self.signature.bucket
        sizes, fixed = smaller_buckets(full), _only_at_its_batch(module)
        held = [size for size in getattr(module, "batches", ()) if size < full]
        if fixed and held:  # a .pt2's other models: each tried as a bucket
            sizes, fixed = held, None
        if fixed or not sizes:
            return dict.fromkeys(sizes, fixed)
        generator = np.random.default_rng(0)
        rows = [
            random_rows(
                generator, spec.dtype, (full, *spec.dims), self.signature.detections, spec.values
            )
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
    generator: np.random.Generator,
    dtype: np.dtype,
    shape,
    photos: bool = False,
    values: tuple[int, int] | None = None,
) -> np.ndarray:
    """Random rows of a served input: floats in [0, 1), booleans, integers in ``values``
    (an integer input's range in the test data: token ids, lengths), uint8 images in
    [0, 255]. With ``photos`` (a detector's images, [N, 3, H, W]), N distinct views of
    real photographs (``varied_photos``): a detector answers random pixels with nearly
    the same detections whatever they are, so one row's answer could pass for another's."""
    if photos and len(shape) == 4 and shape[1] == 3:
        from bladesmith.images import varied_photos

        seed = int(generator.integers(2**31))
        rows = varied_photos(shape[0], tuple(shape[2:]), seed).numpy()
        return np.rint(rows * 255).astype(np.uint8) if dtype == np.uint8 else rows
    if dtype == np.bool_:
        return generator.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        low, high = values if values is not None else (0, 255)  # uint8 images
        return generator.integers(low, high, shape, dtype=dtype, endpoint=True)
    return generator.random(shape, dtype=np.float32).astype(dtype, copy=False)


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


def _stage(staging: list[torch.Tensor], blocks: list[list[np.ndarray]], inputs) -> int:
    """Copy blocks of rows (per block, one array per input) into a bucket's staging
    buffers, the rest padded with each input's ``fill``; returns the rows filled."""
    filled = 0
    for block in blocks:
        count = block[0].shape[0]
        for buffer, array in zip(staging, block):
            # A per-row scalar comes as [N, 1] and goes to the model as [N].
            buffer.numpy()[filled : filled + count] = array.reshape(count, *buffer.shape[1:])
        filled += count
    for buffer, spec in zip(staging, inputs):
        buffer.numpy()[filled:] = spec.fill
    return filled


def _own(value: np.ndarray, buffers: list[np.ndarray]) -> np.ndarray:
    """``value``, copied if it shares memory with one of ``buffers``."""
    return value.copy() if any(np.may_share_memory(value, b) for b in buffers) else value


def _all_finite(array: np.ndarray) -> bool:
    # A sum is finite when every value is, unless it overflows: then look at each.
    return bool(np.isfinite(array.sum())) or bool(np.isfinite(array).all())


def _flat_outputs(run, tensors: list[torch.Tensor], device, uint8_images: bool) -> list[np.ndarray]:
    """``run``'s outputs, as numpy arrays, on a bucket's staging buffers made what the
    model takes (moved to its GPU; uint8 images made float32 / 255)."""
    if device.type == "cuda":  # a graph's inputs live on its device
        tensors = [t.to(device, non_blocking=True) for t in tensors]
    if uint8_images:
        tensors = [tensors[0].float().div_(255)]
    with torch.no_grad():
        outputs = run(*tensors)
    return _numpy_leaves(outputs)


def _numpy_leaves(outputs) -> list[np.ndarray]:
    """An artifact's outputs, flattened, as numpy arrays."""
    return [_to_numpy(value) for value in pytree.tree_leaves(outputs)]


def _graphed(run, device: torch.device, signature: Signature):
    """``run`` replayed from a CUDA graph captured now on a padding bucket, or ``run`` itself
    where the artifact cannot be captured (said on stderr: the server still serves)."""
    from bladesmith.runtimes.cuda_graph import CudaGraphRunner

    graphed = CudaGraphRunner(run, device)
    inputs = _filled(signature.inputs, signature.bucket, signature.uint8_images, device)
    try:
        with torch.no_grad():
            graphed(*inputs)
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
