"""Triton model repositories for bladesmith artifacts (``bladesmith export triton``).

    REPO/NAME/config.pbtxt
    REPO/NAME/1/model.py + the artifact          (python: any artifact, batches into buckets)
    REPO/NAME/1/model.pt + libbladesmith_ops.so  (pytorch_libtorch: TorchScript)
    REPO/NAME/1/model.onnx                       (onnxruntime: standard ONNX)
    REPO/README.md                               (how to start tritonserver on it)

The Python backend batches requests dynamically and runs them in buckets: the artifact's
batch, and the powers of two below it where the artifact runs at them (padded). The
native backends hand the model whatever batch Triton forms, and a bladesmith artifact is
fixed to the batch it was built for, so their configs declare that exact shape
(max_batch_size 0) and clients send whole batches.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bladesmith._files import write_atomically
from bladesmith.errors import BladesmithError
from bladesmith.serve.signature import TRITON_DTYPES, Signature, TensorSpec
from bladesmith.spec import ONNX_SUFFIX, TORCHSCRIPT_SUFFIX

BACKENDS = ("python", "pytorch_libtorch", "onnxruntime")
VERSION = "1"
_STANDARD_ONNX_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


@dataclass(frozen=True)
class Deployment:
    """How Triton runs the model: batching and instances."""

    max_batch: int | None = None  # rows per server-side batch; None: the artifact's batch
    max_queue_delay_us: int = 500
    instances: int = 1
    device: str | None = None  # cpu, cuda, cuda:0,1; None: the artifact's
    torch_threads: int = 0  # per instance (Python backend); 0: torch's default
    image_dtype: str = "float32"  # a detector's images: float32, or uint8 (x / 255 on the device)


def default_backend(artifact: Path) -> str:
    return {TORCHSCRIPT_SUFFIX: "pytorch_libtorch", ONNX_SUFFIX: "onnxruntime"}.get(
        artifact.suffix, "python"
    )


def write_repository(
    artifact: str | Path,
    repository: str | Path,
    *,
    name: str | None = None,
    backend: str | None = None,
    deployment: Deployment = Deployment(),
    libraries: tuple[str | Path, ...] = (),
    link: bool = False,
) -> Path:
    """Write a model repository serving ``artifact`` and return the model's folder.
    ``libraries``: operator libraries the artifact needs besides bladesmith's own;
    ``link``: symlink the artifact instead of copying it (a repository for this machine)."""
    artifact = Path(artifact).resolve()
    if not artifact.is_file():
        raise BladesmithError(f"ARTIFACT: no file {str(artifact)!r}")
    backend = backend or default_backend(artifact)
    if backend not in BACKENDS:
        raise BladesmithError(f"export triton: --backend must be one of {', '.join(BACKENDS)}")
    name = name or artifact.stem
    model_dir = Path(repository) / name
    version_dir = model_dir / VERSION
    if model_dir.exists():
        raise BladesmithError(
            f"export triton: {str(model_dir)!r} exists; choose another --name or REPO_DIR"
        )
    version_dir.mkdir(parents=True)
    try:
        if backend != "python" and deployment.image_dtype != "float32":
            raise BladesmithError(
                f"--image-dtype {deployment.image_dtype}: only the python backend converts "
                f"images; the {backend} backend runs the artifact as it is"
            )
        if backend == "python":
            config, readme = _python_model(artifact, version_dir, deployment, libraries, link)
        elif backend == "pytorch_libtorch":
            config, readme = _torchscript_model(artifact, version_dir, deployment, libraries)
        elif libraries:
            raise BladesmithError("--load-library: the onnxruntime backend runs standard ONNX only")
        else:
            config, readme = _onnx_model(artifact, version_dir, deployment)
    except BaseException:
        shutil.rmtree(model_dir)
        raise
    _write_text(model_dir / "config.pbtxt", f'name: "{name}"\n{config}')
    _write_text(Path(repository) / "README.md", readme.format(repository=Path(repository)))
    return model_dir


def _python_model(artifact, version_dir, deployment, libraries, link):
    import torch

    import bladesmith
    from bladesmith.serve.signature import signature_of

    libraries = [_library(library) for library in libraries]
    for library in libraries:
        torch.ops.load_library(str(library))
    loaded = bladesmith.load(artifact)
    gpus = _gpus(artifact, loaded.device, deployment.device)
    signature = signature_of(loaded, deployment.image_dtype)
    compute_dtype = loaded.spec.dtype
    del loaded
    if gpus is not None:
        torch.cuda.empty_cache()  # the instances load their own copies; this one is done
    target = version_dir / artifact.name
    if link:
        target.symlink_to(artifact)
    else:
        shutil.copy2(artifact, target)
    shutil.copy2(Path(__file__).with_name("python_model.py"), version_dir / "model.py")
    for library in libraries:
        shutil.copy2(library, version_dir / library.name)
    max_batch = deployment.max_batch or signature.bucket
    parameters = {
        "artifact": artifact.name,
        "libraries": json.dumps([library.name for library in libraries]),
        "torch_threads": str(deployment.torch_threads),
        "image_dtype": deployment.image_dtype,
        "compute_dtype": compute_dtype,
    }
    if link:
        parameters["bladesmith_source"] = str(Path(bladesmith.__file__).parent.parent)
    config = "\n".join(
        [
            'backend: "python"',
            f"max_batch_size: {max_batch}",
            *_tensors("input", signature.inputs),
            *_tensors("output", signature.outputs),
            _dynamic_batching(signature.bucket, max_batch, deployment.max_queue_delay_us),
            _instance_group(deployment.instances, gpus),
            *(
                f'parameters: {{ key: "{key}" value: {{ string_value: {json.dumps(value)} }} }}'
                for key, value in parameters.items()
            ),
        ]
    )
    return config + "\n", _PYTHON_README.format(
        python=sys.executable,
        libdir=sysconfig.get_config_var("LIBDIR"),
        bindir=Path(sys.executable).parent,
    )


def _write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda temporary: temporary.write_text(text))


def _library(path) -> Path:
    library = Path(path).resolve()
    if not library.is_file():
        raise BladesmithError(f"--load-library: no file {str(library)!r}")
    return library


def _gpus(artifact: Path, device, wanted: str | None) -> tuple[int, ...] | None:
    """The GPUs to run on (None: the CPU): ``wanted`` (--device), else the artifact's."""
    if wanted is None:
        return (device.index or 0,) if device.type == "cuda" else None
    gpus = parse_gpus(wanted)
    if (gpus is not None) != (device.type == "cuda"):
        raise BladesmithError(
            f"--device {wanted}: {artifact.name} was optimized for {device} and runs only "
            "there; optimize the model for that device, or leave --device out"
        )
    return gpus


def parse_gpus(device: str) -> tuple[int, ...] | None:
    """``cpu`` -> None, ``cuda`` -> (0,), ``cuda:0,1`` -> (0, 1)."""
    if device == "cpu":
        return None
    kind, _, indices = device.partition(":")
    try:
        if kind == "cuda":
            return tuple(int(index) for index in indices.split(",")) if indices else (0,)
    except ValueError:
        pass
    raise BladesmithError(f"--device: expected cpu, cuda or cuda:N[,M...]; got {device!r}")


def _torchscript_model(artifact, version_dir, deployment, libraries):
    import torch

    import bladesmith
    from bladesmith import ops
    from bladesmith.serve.signature import signature_of

    libraries = [_library(library) for library in libraries]
    for library in libraries:
        torch.ops.load_library(str(library))
    loaded = bladesmith.load(artifact)  # builds and loads bladesmith's operators
    libraries.insert(0, Path(ops.library_path()))
    gpus = _gpus(artifact, loaded.device, deployment.device)
    signature = signature_of(loaded)
    shutil.copy2(artifact, version_dir / "model.pt")
    for library in libraries:
        shutil.copy2(library, version_dir / library.name)
    # Triton's libtorch backend binds tensors by position: NAME__INDEX.
    stems = ("INPUT", "OUTPUT") if not signature.detections else (None, None)
    inputs = _fixed(signature.inputs, signature.bucket, stems[0])
    outputs = _fixed(signature.outputs, signature.bucket, stems[1])
    config = "\n".join(
        [
            'backend: "pytorch"',
            'platform: "pytorch_libtorch"',
            "max_batch_size: 0",
            *_tensors("input", inputs),
            *_tensors("output", outputs),
            _instance_group(deployment.instances, gpus),
        ]
    )
    folder = f"{{repository}}/{version_dir.parent.name}/{VERSION}"
    preload = ":".join(f"{folder}/{library.name}" for library in libraries)
    return config + "\n", _TORCHSCRIPT_README.format(
        torch_version=torch.__version__.split("+")[0],
        preload=preload,
        library=", ".join(library.name for library in libraries),
    )


def _onnx_model(artifact, version_dir, deployment):
    import onnx

    model = onnx.load(str(artifact), load_external_data=False)
    custom = sorted({node.domain for node in model.graph.node} - set(_STANDARD_ONNX_DOMAINS))
    if custom:
        raise BladesmithError(
            f"export triton: {str(artifact)!r} uses custom operator domains {custom}, which "
            "Triton's onnxruntime backend cannot run: export standard ONNX "
            "(bladesmith export onnx ... --custom-ops standard) or use --backend python"
        )
    initializers = {init.name for init in model.graph.initializer}
    inputs = [_onnx_tensor(v) for v in model.graph.input if v.name not in initializers]
    outputs = [_onnx_tensor(v) for v in model.graph.output]
    shutil.copy2(artifact, version_dir / "model.onnx")
    config = "\n".join(
        [
            'backend: "onnxruntime"',
            'platform: "onnxruntime_onnx"',
            "max_batch_size: 0",
            *_tensors("input", inputs),
            *_tensors("output", outputs),
            _instance_group(deployment.instances, parse_gpus(deployment.device or "cpu")),
        ]
    )
    return config + "\n", _ONNX_README


def _onnx_tensor(value) -> TensorSpec:
    from onnx import helper

    tensor_type = value.type.tensor_type
    # A dimension the file leaves free (a batch exported dynamic) is Triton's -1.
    dims = [dim.dim_value if dim.HasField("dim_value") else -1 for dim in tensor_type.shape.dim]
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
    if dtype not in TRITON_DTYPES:
        raise BladesmithError(f"export triton: ONNX tensor {value.name!r} has dtype {dtype}")
    return TensorSpec(value.name, dtype, tuple(dims))


def _fixed(specs, bucket: int, stem: str | None) -> list[TensorSpec]:
    """Whole-batch tensors (max_batch_size 0), named NAME__INDEX."""
    return [
        TensorSpec(
            f"{stem or spec.name}__{index}",
            spec.dtype,
            (bucket,) if spec.scalar else (bucket, *spec.dims),
        )
        for index, spec in enumerate(specs)
    ]


def _tensors(kind: str, specs) -> list[str]:
    return [
        f'{kind} [{{ name: "{spec.name}" data_type: TYPE_{spec.triton_dtype} '
        f"dims: [{', '.join(map(str, spec.dims))}] }}]"
        for spec in specs
    ]


def _dynamic_batching(bucket: int, max_batch: int, delay_us: int) -> str:
    preferred = [size for size in range(bucket, max_batch + 1, bucket)] or [max_batch]
    return (
        f"dynamic_batching {{ preferred_batch_size: [{', '.join(map(str, preferred))}] "
        f"max_queue_delay_microseconds: {delay_us} }}"
    )


def _instance_group(count: int, gpus: tuple[int, ...] | None) -> str:
    if gpus is None:
        return f"instance_group [{{ count: {count} kind: KIND_CPU }}]"
    return (
        f"instance_group [{{ count: {count} kind: KIND_GPU gpus: [{', '.join(map(str, gpus))}] }}]"
    )


def signature_from_config(config_text: str) -> Signature:
    """Parse a repository's ``config.pbtxt`` with Triton's own protobuf definitions."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_text, model_config_pb2.ModelConfig())
    by_triton = {triton: dtype for dtype, triton in TRITON_DTYPES.items()}

    def spec(tensor):
        dtype = model_config_pb2.DataType.Name(tensor.data_type).removeprefix("TYPE_")
        return TensorSpec(tensor.name, by_triton[dtype], tuple(tensor.dims))

    return Signature(
        tuple(spec(t) for t in config.input),
        tuple(spec(t) for t in config.output),
        config.max_batch_size,
        detections=False,
    )


_PYTHON_README = """# Triton model repository (Python backend)

Any bladesmith artifact, batched dynamically up to the artifact's batch size. The backend
runs the model with the Python environment whose interpreter is first on PATH, which must
have bladesmith installed (pip install 'bladesmith[serve]'); this one was written by
{python}:

    LD_LIBRARY_PATH={libdir}:$LD_LIBRARY_PATH PATH={bindir}:$PATH \\
    tritonserver --model-repository {{repository}}

The interpreter's own libpython goes first on LD_LIBRARY_PATH: the backend's stub would
otherwise load the system's, which fails with a Python built elsewhere. Triton's Python
backend stub must match the interpreter's version (nvidia-pytriton bundles a server with
one per version: `bladesmith serve ARTIFACT` uses it and sets all this for you).
"""

_TORCHSCRIPT_README = """# Triton model repository (pytorch_libtorch backend)

The TorchScript model calls bladesmith's custom operators, compiled into
{library} beside it (with any --load-library). Start a Triton whose libtorch
backend is built against PyTorch {torch_version} (the NGC container of that release)
with the libraries preloaded:

    LD_PRELOAD={preload} tritonserver --model-repository {{repository}}

Inputs and outputs are whole batches of the size the artifact was built for
(max_batch_size 0): Triton's native backends do not pad a partial batch; the Python
backend (`bladesmith export triton ARTIFACT REPO --backend python`) does.
"""

_ONNX_README = """# Triton model repository (onnxruntime backend)

Standard ONNX only, no custom operators:

    tritonserver --model-repository {repository}

Inputs and outputs are whole batches of the size the model was exported for
(max_batch_size 0).
"""
