"""Triton model repositories for bladesmith artifacts (``bladesmith export triton``).

    REPO/NAME/config.pbtxt
    REPO/NAME/1/model.py + the artifact          (python: any artifact, batches into buckets;
                                                  ARTIFACT.libs/ beside it)
    REPO/NAME/1/model.pt + the operator libraries it calls, preloaded
                                                 (pytorch_libtorch: TorchScript)
    REPO/NAME/1/model.onnx                       (onnxruntime: standard ONNX)
    REPO/README.md                               (how to start tritonserver on it: one
                                                  section per model, merged by name)

The Python backend batches requests dynamically and runs them in buckets: the artifact's
batch, and the powers of two below it where the artifact runs at them (padded). The
native backends hand the model whatever batch Triton forms, and a bladesmith artifact is
fixed to the batch it was built for, so their configs declare that exact shape
(max_batch_size 0) and clients send whole batches.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bladesmith._files import write_atomically
from bladesmith.errors import BladesmithError, NotAnArtifactError
from bladesmith.onnx import custom_nodes
from bladesmith.ops import libraries as operator_libraries
from bladesmith.ops.namespaces import registered_from_python_only
from bladesmith.runtimes.formats import FORMATS
from bladesmith.serve.signature import NUMPY_DTYPES, TRITON_DTYPES, Signature, TensorSpec
from bladesmith.trust import require

# The files each backend runs, as each format says (Format.triton_backend): a wrong pair
# would write a repository Triton cannot load. The Python backend runs any artifact.
BACKEND_SUFFIXES = {
    "python": tuple(FORMATS),
    **{each.triton_backend: (suffix,) for suffix, each in FORMATS.items() if each.triton_backend},
}
BACKENDS = tuple(BACKEND_SUFFIXES)
_BACKENDS_TAKE = ", ".join(
    [
        *(
            f"{backend} takes a {suffixes[0]}"
            for backend, suffixes in BACKEND_SUFFIXES.items()
            if backend != "python"
        ),
        f"python any bladesmith artifact ({', '.join(FORMATS)})",
    ]
)
# Triton names a model by its folder; letters, digits, '_', '-' and '.' (not first) are
# safe everywhere (URLs, file systems, metric labels).
_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# What a tensor name (an ONNX graph's: "input.1", "onnx::Gemm_12", "/body/Conv_output_0")
# may hold to be written into config.pbtxt as it is: no quote, backslash or line break
# that could end its string and add fields.
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,256}")
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
    trust: bool = False  # bladesmith.load's: run the code the artifact brings


def default_backend(artifact: Path) -> str:
    """The format's own Triton backend, else the Python backend."""
    each = FORMATS.get(artifact.suffix)
    return (each.triton_backend if each is not None else None) or "python"


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
    if artifact.suffix not in BACKEND_SUFFIXES[backend]:
        raise BladesmithError(f"--backend {backend} cannot serve {artifact.name}: {_BACKENDS_TAKE}")
    name = check_model_name(name, artifact)
    repository = Path(repository)
    if repository.exists() and not repository.is_dir():
        raise BladesmithError(
            f"REPO_DIR {str(repository)!r} is a file, not a folder: name a folder (it is "
            "created if missing)"
        )
    model_dir = repository / name
    version_dir = model_dir / VERSION
    if model_dir.exists():
        raise BladesmithError(
            f"export triton: {str(model_dir)!r} exists; choose another --name or REPO_DIR"
        )
    try:
        version_dir.mkdir(parents=True)
    except OSError as error:
        raise BladesmithError(
            f"REPO_DIR {str(repository)!r}: cannot create {str(version_dir)!r}: "
            f"{error.strerror or error}"
        ) from None
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
    _update_readme(repository, name, readme)
    return model_dir


def check_model_name(name: str | None, artifact: Path) -> str:
    """``name`` (default: the artifact's stem) if Triton can serve a model by it."""
    chosen = name if name is not None else artifact.stem
    if not _MODEL_NAME.fullmatch(chosen):
        source = (
            f"--name {chosen!r}"
            if name is not None
            else (f"the model name {chosen!r} (the file's stem)")
        )
        raise BladesmithError(
            f"{source}: a model name is letters, digits, '_', '-' and '.' (not first), at "
            "most 128 characters; choose another --name"
        )
    return chosen


def _python_model(artifact, version_dir, deployment, libraries, link):
    import torch

    import bladesmith
    from bladesmith.serve.signature import signature_of

    libraries = [_library(library) for library in libraries]
    _instances_trusted(artifact, deployment, libraries)
    for library in libraries:
        torch.ops.load_library(str(library))
    try:
        loaded = bladesmith.load(artifact, trust=deployment.trust)
    except NotAnArtifactError:
        plain = _PLAIN_ONNX.format(name=artifact.name) if artifact.suffix == ".onnx" else ""
        raise NotAnArtifactError(_NOT_AN_ARTIFACT.format(name=artifact.name) + plain) from None
    gpus = _gpus(artifact, loaded.device, deployment.device)
    signature = signature_of(loaded, deployment.image_dtype)
    compute_dtype = loaded.spec.dtype
    del loaded
    if gpus is not None:
        torch.cuda.empty_cache()  # the instances load their own copies; this one is done
    # The operator libraries saved with the artifact go beside it, where bladesmith.load
    # finds them in each model instance.
    folder = operator_libraries.stored(artifact)
    if link:
        (version_dir / artifact.name).symlink_to(artifact)
        if folder is not None:
            (version_dir / folder.name).symlink_to(folder)
    else:
        shutil.copy2(artifact, version_dir / artifact.name)
        if folder is not None:
            shutil.copytree(folder, version_dir / folder.name)
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
        "trust": "true" if deployment.trust else "false",
        # What a client's test rows of an integer input draw from (loadtest).
        "input_ranges": json.dumps(
            {spec.name: spec.values for spec in signature.inputs if spec.values is not None}
        ),
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
    return config + "\n", {
        "backend": "python",
        "python": sys.executable,
        "libdir": sysconfig.get_config_var("LIBDIR"),
        "bindir": str(Path(sys.executable).parent),
        "stored_libraries": folder.name if folder is not None else None,
        "preload": [],
    }


def _instances_trusted(artifact: Path, deployment: Deployment, given: list[Path]) -> None:
    """Refuse, in one line before anything is written, an artifact whose own operator
    libraries the server would load (each model instance, or tritonserver) without
    ``trust``; where this process has loaded them already, ``bladesmith.load`` would not
    ask. Libraries given with --load-library are the user's own."""
    folder = operator_libraries.stored(artifact)
    if folder is not None and not given:
        what = f"the native libraries in {folder.name}/ (in the server's processes)"
        require(artifact, what, deployment.trust, "serve")


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

    given = [_library(library) for library in libraries]
    _instances_trusted(artifact, deployment, given)
    for library in given:
        torch.ops.load_library(str(library))
    # Builds and loads bladesmith's operators, and the libraries saved beside the artifact.
    loaded = bladesmith.load(artifact, trust=deployment.trust)
    operators = custom_operators(artifact)
    preload = [Path(ops.library_path())] if any(_is_bladesmiths(op) for op in operators) else []
    preload += given
    preload += [found.path for found in _libraries_defining(operators, artifact)]
    preload = list(dict.fromkeys(preload))  # a --load-library that defines them: once
    gpus = _gpus(artifact, loaded.device, deployment.device)
    signature = signature_of(loaded)
    shutil.copy2(artifact, version_dir / "model.pt")
    for library in preload:
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
    folder = f"{version_dir.parent.name}/{VERSION}"
    return config + "\n", {
        "backend": "pytorch_libtorch",
        "torch_version": torch.__version__.split("+")[0],
        "operators": sorted(operators),
        "preload": [f"{folder}/{library.name}" for library in preload],
    }


_OPERATOR_CALL = re.compile(rb"\bops\.(\w+)\.(\w+)")


def custom_operators(artifact: Path) -> set[str]:
    """The custom operators a TorchScript file calls, bladesmith's, the user's and those
    torch registers from Python only (``ops.NAMESPACE.NAME`` in its code), as
    ``NAMESPACE::NAME``."""
    with zipfile.ZipFile(artifact) as archive:
        code = [
            archive.read(entry)
            for entry in archive.namelist()
            if "/code/" in entry and entry.endswith(".py")
        ]
    called = {
        f"{namespace.decode()}::{name.decode()}"
        for text in code
        for namespace, name in _OPERATOR_CALL.findall(text)
    }
    return {
        op
        for op in called
        if _is_bladesmiths(op)
        or operator_libraries.is_user_operator(op)
        or registered_from_python_only(op.partition("::")[0])
    }


def _is_bladesmiths(operator: str) -> bool:
    return operator.startswith("bladesmith::")


def _libraries_defining(operators, artifact: Path) -> list:
    """The loaded libraries that define the user's ``operators``; one line for an operator
    that none does (registered from Python: Triton cannot preload it)."""
    users = {op for op in operators if not _is_bladesmiths(op)}
    torchs = sorted(op for op in users if registered_from_python_only(op.partition("::")[0]))
    if torchs:
        raise BladesmithError(
            f"export triton: {artifact.name} calls {', '.join(torchs)}, which torch registers "
            "from Python only: Triton's libtorch backend runs without Python and lacks it; "
            "use --backend python"
        )
    found = operator_libraries.libraries_of(users)
    unfound = sorted(users.difference(*(library.operators for library in found)))
    if unfound:
        raise BladesmithError(
            f"export triton: {artifact.name} calls {', '.join(unfound)}, which no loaded "
            "library file defines (registered from Python?); Triton's libtorch backend "
            "preloads compiled libraries: pass the one that registers it with --load-library"
        )
    return found


def _onnx_model(artifact, version_dir, deployment):
    import onnx

    model = onnx.load(str(artifact), load_external_data=False)
    custom = sorted({node.domain for node in model.graph.node} - set(_STANDARD_ONNX_DOMAINS))
    if custom:
        # --custom-ops standard lowers bladesmith's operators, not the user's custom nodes.
        users = sorted({entry["operator"] for entry in custom_nodes.listed(model)})
        lower = (
            f"with a lowering of {', '.join(users)} (bladesmith.onnx.register_op(NAME, "
            "onnxscript=...) from Python, then custom_ops='standard')"
            if users
            else "(bladesmith export onnx ... --custom-ops standard)"
        )
        raise BladesmithError(
            f"export triton: {str(artifact)!r} uses custom operator domains {custom}, which "
            f"Triton's onnxruntime backend cannot run: export standard ONNX {lower} or use "
            "--backend python"
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
    return config + "\n", {"backend": "onnxruntime", "preload": []}


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
    for spec in specs:
        if not _TENSOR_NAME.fullmatch(spec.name):
            raise BladesmithError(
                f"export triton: the model's {kind} tensor {spec.name!r} cannot be named in "
                "config.pbtxt (a tensor name is letters, digits and _ . : / -, at most 256): "
                "rename it in the model file"
            )
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

    def spec(tensor):
        dtype = model_config_pb2.DataType.Name(tensor.data_type).removeprefix("TYPE_")
        return TensorSpec(tensor.name, NUMPY_DTYPES[dtype], tuple(tensor.dims))

    return Signature(
        tuple(spec(t) for t in config.input),
        tuple(spec(t) for t in config.output),
        config.max_batch_size,
        detections=False,
    )


_NOT_AN_ARTIFACT = (
    "{name} was not written by bladesmith.save (`bladesmith export onnx` and "
    "torch.jit.save write plain files, without the batch, device and outputs bladesmith "
    "serves by): save one with `bladesmith optimize MODEL --out {name}`"
)
# Triton's onnxruntime backend reads a standard ONNX file's inputs and outputs itself.
_PLAIN_ONNX = (
    ", or put a standard one (`bladesmith export onnx ... --custom-ops standard`) on a "
    "Triton of your own: `bladesmith export triton {name} REPO_DIR --backend onnxruntime`"
)
_SECTION = re.compile(r"^<!-- bladesmith model (\{.*\}) -->\n", re.MULTILINE)


def _update_readme(repository: Path, name: str, info: dict) -> None:
    """REPO/README.md: how to start Triton on every model of the repository, then one
    section per model; this model's section replaces any earlier one of the same name,
    and sections of models no longer in the repository are dropped."""
    path = repository / "README.md"
    models: dict[str, dict] = {}
    if path.is_file():
        parts = _SECTION.split(path.read_text())
        for meta in parts[1::2]:
            try:
                found = json.loads(meta)
                models[found["name"]] = found
            except (ValueError, KeyError, TypeError):
                continue
    models[name] = {"name": name, **info}
    models = {key: value for key, value in models.items() if (repository / key).is_dir()}
    text = _readme_header(repository, list(models.values())) + "".join(
        f"<!-- bladesmith model {json.dumps(model, sort_keys=True)} -->\n{_section(model)}"
        for model in models.values()
    )
    _write_text(path, text)


def _readme_header(repository: Path, models: list[dict]) -> str:
    preload = list(dict.fromkeys(f"$REPO/{item}" for m in models for item in m["preload"]))
    python = next((m for m in models if m["backend"] == "python"), None)
    environment = []
    if preload:
        environment.append(f"LD_PRELOAD={':'.join(preload)}")
    if python:
        environment.append(f"LD_LIBRARY_PATH={shlex.quote(python['libdir'])}:$LD_LIBRARY_PATH")
        environment.append(f"PATH={shlex.quote(python['bindir'])}:$PATH")
    launch = " \\\n    ".join([*environment, 'tritonserver --model-repository "$REPO"'])
    listed = ", ".join(f"{m['name']} ({m['backend']})" for m in models)
    return _README_HEADER.format(
        models=listed,
        repository=shlex.quote(str(repository.resolve())),
        launch=launch,
    )


def _section(model: dict) -> str:
    name, backend = model["name"], model["backend"]
    if backend == "python":
        body = _PYTHON_SECTION.format(**model)
        if model.get("stored_libraries"):
            body += _STORED_LIBRARIES.format(folder=model["stored_libraries"])
    elif backend == "pytorch_libtorch":
        libraries = ", ".join(item.rsplit("/", 1)[-1] for item in model["preload"])
        operators = ", ".join(model.get("operators", []))
        if libraries:
            calls = f"it calls the custom operators {operators}; " if operators else ""
            uses = (
                f"{calls}the operator libraries {libraries} are beside it (with any "
                "--load-library), and the launch line above preloads them (LD_PRELOAD)."
            )
        else:
            uses = "it calls no custom operator, so nothing is preloaded for it."
        body = _TORCHSCRIPT_SECTION.format(uses=uses, **model)
    else:
        body = _ONNX_SECTION
    return f"\n## {name} ({backend} backend)\n\n{body}"


_README_HEADER = """# Triton model repository

Written by `bladesmith export triton`. Models: {models}.

Start one Triton on all of them (REPO is where this repository was written: change it
if you move the repository):

    REPO={repository}
    {launch}

Each model's section below says what its backend needs.
"""

_PYTHON_SECTION = """Any bladesmith artifact, batched dynamically up to the artifact's
batch size. The backend runs the model with the Python environment whose interpreter is
first on PATH, which must have bladesmith installed (pip install 'bladesmith[serve]');
this one was written by {python}, whose folder the launch line above puts first on PATH.

The interpreter's own libpython goes first on LD_LIBRARY_PATH: the backend's stub would
otherwise load the system's, which fails with a Python built elsewhere. Triton's Python
backend stub must match the interpreter's version (nvidia-pytriton bundles a server with
one per version: `bladesmith serve ARTIFACT` uses it and sets all this for you).
"""

_STORED_LIBRARIES = """
The operator libraries saved with the artifact are beside it ({folder}/), and each model
instance loads them with it (libraries given with --load-library are listed in
config.pbtxt and loaded first).
"""

_TORCHSCRIPT_SECTION = """TorchScript: {uses}
Triton's libtorch backend must be built against PyTorch {torch_version} (the NGC container
of that release).

Inputs and outputs are whole batches of the size the artifact was built for
(max_batch_size 0): Triton's native backends do not pad a partial batch; the Python
backend (`bladesmith export triton ARTIFACT REPO --backend python`) does.
"""

_ONNX_SECTION = """Standard ONNX only, no custom operators. Inputs and outputs are whole
batches of the size the model was exported for (max_batch_size 0).
"""
