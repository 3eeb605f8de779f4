"""doctor(): what this machine can run, and the pitfalls that would cost days.

It reports versions, devices, ONNX Runtime providers, the toolchain for building the
custom operators, and pitfalls, each with a fix. The doctor has to work on a broken
install: it reads package metadata instead of importing where it can, turns a failing
import into a pitfall, and never builds anything. Each check is a function of its
inputs (installed packages, directories, versions), so tests can feed it any machine.
"""

from __future__ import annotations

import ast
import codecs
import dataclasses
import importlib
import importlib.metadata
import os
import platform
import re
import site
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bladesmith.toolchain import Tool, find_compiler, find_ninja, find_nvcc

if TYPE_CHECKING:
    from bladesmith.devices import DeviceInfo

SEVERITIES = ("error", "warning", "info")
MIN_TORCH = (2, 6)
# Distributions that all install the one `onnxruntime` import package.
ONNXRUNTIME_VARIANTS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "onnxruntime-training",
    "ort-nightly",
    "ort-nightly-gpu",
    "ort-nightly-directml",
)
_SHOWN_PACKAGES = ("torch", "torchvision", "onnx", "onnxscript", "onnxruntime-extensions")
_IS_WINDOWS = os.name == "nt"
_TORCH_INSTALL = "install torch and torchvision from https://pytorch.org/get-started/locally/"


@dataclass
class Pitfall:
    id: str
    severity: str  # one of SEVERITIES; "error" makes `bladesmith doctor` exit non-zero
    message: str
    fix: str


@dataclass
class Package:
    name: str
    version: str | None  # None: not installed
    detail: str = ""


@dataclass
class OpsStatus:
    """What ``bladesmith.ops.build.status()`` said; ``available`` False when it is absent."""

    available: bool
    built: bool | None = None
    path: str | None = None
    loadable: bool | None = None
    detail: str = ""


@dataclass
class Toolchain:
    compiler: Tool
    ninja: Tool
    nvcc: Tool
    torch_cuda: str | None  # torch.version.cuda
    nvcc_cuda: str | None  # "major.minor" of nvcc's release
    nvcc_matches_torch: bool | None  # major.minor equal; None when either is unknown
    ops: OpsStatus


@dataclass
class DoctorResult:
    platform: str
    packages: list[Package]
    devices: list[DeviceInfo]
    providers: list[str]  # onnxruntime.get_available_providers()
    toolchain: Toolchain
    pitfalls: list[Pitfall] = field(default_factory=list)

    @property
    def errors(self) -> list[Pitfall]:
        return [pitfall for pitfall in self.pitfalls if pitfall.severity == "error"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def doctor(site_dirs: Iterable[str | os.PathLike] = ()) -> DoctorResult:
    """Examine this machine. ``site_dirs`` are scanned for binary .pth files as well as
    this interpreter's site directories (e.g. those of an environment that no longer
    starts; a virtual environment's root stands for its site-packages).
    """
    packages = installed_packages()
    torch_build = _module_constants("torch", "version.py")
    pitfalls: list[Pitfall] = []
    devices = _collect_devices(packages, torch_build.get("cuda"), pitfalls)
    providers = _collect_providers(packages, pitfalls)
    toolchain = collect_toolchain(torch_build.get("cuda"))
    named = [site for directory in site_dirs for site in environment_site_dirs(directory)]
    pitfalls += check_binary_pth([*site_directories(), *named])
    pitfalls += check_torch(packages)
    pitfalls += check_torch_torchvision(packages)
    pitfalls += check_onnxruntime_variants(packages)
    pitfalls += check_cuda_toolkit(toolchain.torch_cuda, toolchain.nvcc_cuda)
    pitfalls += check_build_tools(toolchain, cuda_gpus=sum(d.kind == "cuda" for d in devices))
    pitfalls.sort(key=lambda pitfall: SEVERITIES.index(pitfall.severity))
    return DoctorResult(
        platform=platform.platform(),
        packages=_shown_packages(packages, torch_build),
        devices=devices,
        providers=providers,
        toolchain=toolchain,
        pitfalls=pitfalls,
    )


# -- packages -------------------------------------------------------------------------


def normalize_name(name: str) -> str:
    """PEP 503 name: "ONNXRuntime_GPU" -> "onnxruntime-gpu"."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_packages() -> dict[str, str]:
    """Normalised distribution name -> version, for the distributions Python would import.

    torch and torchvision get their build tag (e.g. "+cu130") from their version.py when
    the metadata lacks it, so that builds can be compared.
    """
    packages: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        try:
            name, version = normalize_name(dist.metadata["Name"]), dist.version
        except Exception:  # a half-uninstalled distribution must not stop the doctor
            continue
        if name in packages:  # the first one on sys.path is the one imported
            continue
        if name in ("torch", "torchvision") and "+" not in version:
            built = str(_module_constants(name, "version.py").get("__version__", ""))
            version = built if built.startswith(version) else version
        packages[name] = version
    return packages


def _module_constants(package: str, filename: str) -> dict[str, object]:
    """Literal top-level assignments of a package's file, read without importing it."""
    try:
        path = importlib.metadata.distribution(package).locate_file(f"{package}/{filename}")
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (importlib.metadata.PackageNotFoundError, OSError, SyntaxError, ValueError):
        return {}
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            constants[target.id] = node.value.value
    return constants


def _requirements(distribution: str) -> list[str]:
    try:
        return importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []


def _shown_packages(
    packages: Mapping[str, str], torch_build: Mapping[str, object]
) -> list[Package]:
    from bladesmith import __version__

    runtimes = [name for name in ONNXRUNTIME_VARIANTS if name in packages] or ["onnxruntime"]
    directml = ["torch-directml"] if "torch-directml" in packages else []
    shown = [
        Package("python", platform.python_version(), sys.executable),
        Package("bladesmith", __version__),
        *(Package(name, packages.get(name)) for name in [*_SHOWN_PACKAGES, *runtimes, *directml]),
    ]
    if "torch" in packages:
        cuda, hip = torch_build.get("cuda"), torch_build.get("hip")
        shown[2].detail = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU build"
    shown.append(Package("openvino", packages.get("openvino"), _openvino_devices(packages)))
    return shown


def _openvino_devices(packages: Mapping[str, str]) -> str:
    """The devices OpenVINO finds here, each with its name (the openvino pass and .ov
    use its CPU), or "" where it is not installed; why, in one line, where it fails."""
    if "openvino" not in packages:
        return "pip install 'bladesmith[openvino]' for the openvino pass and .ov files"
    try:
        import openvino

        core = openvino.Core()
        return "devices: " + ", ".join(
            f"{device} ({core.get_property(device, 'FULL_DEVICE_NAME')})"
            for device in core.available_devices
        )
    except Exception as error:  # its plugins raise their own kinds
        return f"does not start: {str(error).strip().splitlines()[0][:200]}"


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as "2.6.0.dev20250101+cu126"."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(part) for part in match.groups() if part is not None) if match else ()


def _build_tag(version: str) -> str:
    """The local version label, "cu130" in "2.14.1+cu130"; "" when there is none."""
    return version.partition("+")[2]


# -- devices and providers --------------------------------------------------------------


def _collect_devices(
    packages: Mapping[str, str], torch_cuda: str | None, pitfalls: list[Pitfall]
) -> list[DeviceInfo]:
    if "torch" not in packages:
        return []  # check_torch reports it
    try:
        from bladesmith import devices

        found = devices.available_devices()
    except Exception as error:  # a broken torch or driver must not stop the doctor
        pitfalls.append(
            Pitfall(
                "torch-broken",
                "error",
                f"torch {packages['torch']} fails to import or to list devices: "
                f"{type(error).__name__}: {error}",
                "reinstall torch from https://pytorch.org/get-started/locally/; if it "
                "imports, check the GPU driver with nvidia-smi",
            )
        )
        return []
    if "torch-directml" in packages:
        try:
            devices.resolve_device("dml")
        except Exception as error:
            pitfalls.append(directml_pitfall(packages, str(error), _requirements("torch-directml")))
    if torch_cuda and not any(device.kind == "cuda" for device in found):
        pitfalls.append(
            Pitfall(
                "cuda-no-gpu",
                "info",
                f"torch {packages['torch']} is a CUDA {torch_cuda} build but sees no GPU: "
                "bladesmith runs on the other devices listed",
                "if this machine has an NVIDIA GPU, check its driver with nvidia-smi and "
                "that CUDA_VISIBLE_DEVICES does not hide it",
            )
        )
    return found


def directml_pitfall(packages: Mapping[str, str], reason: str, requirements: list[str]) -> Pitfall:
    """torch-directml pins the one torch it was built for (0.2.5 pins torch 2.4.1, older
    than bladesmith supports); ONNX Runtime's DirectML provider has no such tie."""
    pins = (re.match(r"torch\s*==\s*([^\s;,]+)", requirement) for requirement in requirements)
    pin = next((match[1] for match in pins if match), None)
    fix = "use DirectML through ONNX Runtime: pip install onnxruntime-directml"
    if pin and pin != packages.get("torch", "").partition("+")[0]:
        reason += f"; torch-directml requires torch {pin}"
        if _release(pin)[:2] < MIN_TORCH:
            fix = f"torch {pin} is older than bladesmith supports: {fix}"
    return Pitfall("directml-unusable", "warning", f"DirectML is not usable: {reason}", fix)


def _collect_providers(packages: Mapping[str, str], pitfalls: list[Pitfall]) -> list[str]:
    if not any(name in packages for name in ONNXRUNTIME_VARIANTS):
        pitfalls.append(
            Pitfall(
                "onnxruntime-missing",
                "warning",
                "ONNX Runtime is not installed: bladesmith cannot run or check ONNX models",
                "pip install onnxruntime (or onnxruntime-gpu / onnxruntime-directml)",
            )
        )
        return []
    try:
        import onnxruntime

        return list(onnxruntime.get_available_providers())
    except Exception as error:
        pitfalls.append(
            Pitfall(
                "onnxruntime-import",
                "error",
                f"onnxruntime fails to import: {type(error).__name__}: {error}",
                "pip install --force-reinstall onnxruntime (or the one variant you use)",
            )
        )
        return []


# -- toolchain --------------------------------------------------------------------------


def collect_toolchain(torch_cuda: str | None) -> Toolchain:
    """The tools torch.utils.cpp_extension would build the operators with, found the way
    it finds them, and the state of the operator library. Never builds."""
    nvcc = find_nvcc()
    nvcc_cuda = ".".join(nvcc.version.split(".")[:2]) if nvcc.version else None
    matches = (
        _release(nvcc_cuda)[:2] == _release(torch_cuda)[:2] if nvcc_cuda and torch_cuda else None
    )
    return Toolchain(
        compiler=find_compiler(),
        ninja=find_ninja(),
        nvcc=nvcc,
        torch_cuda=torch_cuda,
        nvcc_cuda=nvcc_cuda,
        nvcc_matches_torch=matches,
        ops=ops_status(),
    )


def ops_status() -> OpsStatus:
    """Ask bladesmith.ops.build whether the operator library is built and loads."""
    try:
        build = importlib.import_module("bladesmith.ops.build")
    except ModuleNotFoundError as error:
        if error.name not in ("bladesmith.ops", "bladesmith.ops.build"):
            return OpsStatus(False, detail=f"bladesmith.ops.build fails to import: {error}")
        return OpsStatus(False, detail="ops build module not available")
    except Exception as error:
        return OpsStatus(False, detail=f"bladesmith.ops.build fails to import: {error}")
    status = getattr(build, "status", None)
    if status is None:
        return OpsStatus(False, detail="ops build module not available (no status())")
    try:
        found = status()
    except Exception as error:
        return OpsStatus(True, detail=f"status() failed: {type(error).__name__}: {error}")
    return OpsStatus(True, bool(found.built), found.path, found.loadable, str(found.detail))


# -- pitfalls ---------------------------------------------------------------------------


def site_directories() -> list[Path]:
    """The directories whose *.pth files Python reads at start-up: this environment's, its
    base interpreter's and the user's site-packages."""
    prefixes = list(dict.fromkeys([sys.prefix, sys.exec_prefix, sys.base_prefix]))
    directories = [*site.getsitepackages(prefixes), site.getusersitepackages()]
    if _IS_WINDOWS:  # a venv's root is a site directory there
        directories.append(sys.prefix)
    return [Path(directory) for directory in dict.fromkeys(directories)]


def environment_site_dirs(directory: str | os.PathLike) -> list[Path]:
    """The directories to scan for ``directory``: a virtual environment's root (it has a
    pyvenv.cfg) stands for its site-packages (lib/pythonX.Y/site-packages, or
    Lib/site-packages on Windows), and the root itself, which Windows reads as well;
    any other directory is itself."""
    directory = Path(directory)
    if not (directory / "pyvenv.cfg").is_file():
        return [directory]
    found = sorted(directory.glob("lib/python*/site-packages")) + sorted(
        directory.glob("Lib/site-packages")
    )
    return [*found, directory]


def find_binary_pth_files(directories: Iterable[str | os.PathLike]) -> list[Path]:
    """The *.pth files in ``directories`` that are not UTF-8 text."""
    found = []
    for directory in dict.fromkeys(map(Path, directories)):
        if directory.is_dir():
            found += [path for path in sorted(directory.glob("*.pth")) if _is_binary(path)]
    return found


def _is_binary(path: Path, limit: int = 1 << 20) -> bool:
    try:
        with path.open("rb") as file:
            head = file.read(limit)
    except OSError:  # a directory or unreadable file: site skips those too
        return False
    if b"\0" in head:
        return True
    try:
        codecs.getincrementaldecoder("utf-8-sig")().decode(head, final=len(head) < limit)
    except UnicodeDecodeError:
        return True
    return False


def check_binary_pth(directories: Iterable[str | os.PathLike]) -> list[Pitfall]:
    """Python's site module reads every *.pth in a site directory as a text file of paths;
    a weights file saved as model.pth there stops Python and pip from starting, with a
    UnicodeDecodeError that does not name the file."""
    return [
        Pitfall(
            "binary-pth",
            "error",
            f"{path} is not UTF-8 text, yet Python reads every *.pth in {path.parent} as a "
            "list of paths at start-up: Python and pip there fail to start with a "
            "UnicodeDecodeError that does not name this file",
            f"move or rename it (e.g. to {path.with_suffix('.pt').name}) and keep model "
            "weights outside site-packages",
        )
        for path in find_binary_pth_files(directories)
    ]


def check_torch(packages: Mapping[str, str]) -> list[Pitfall]:
    version = packages.get("torch")
    if version is None:
        return [Pitfall("torch-missing", "error", "torch is not installed", _TORCH_INSTALL)]
    if _release(version)[:2] < MIN_TORCH:
        minimum = ".".join(map(str, MIN_TORCH))
        return [
            Pitfall(
                "torch-too-old",
                "error",
                f"torch {version} is installed; bladesmith needs torch >= {minimum}",
                _TORCH_INSTALL,
            )
        ]
    return []


def expected_torchvision_minor(torch_version: str) -> int | None:
    """torchvision 0.(N+15) goes with torch 2.N, and 0.(N+1) with torch 1.N."""
    release = _release(torch_version)
    if len(release) < 2 or release[0] not in (1, 2):
        return None
    return release[1] + (15 if release[0] == 2 else 1)


def check_torch_torchvision(packages: Mapping[str, str]) -> list[Pitfall]:
    """torchvision's compiled ops load only into the torch build they were made for."""
    torch_version, vision_version = packages.get("torch"), packages.get("torchvision")
    if torch_version is None or vision_version is None:
        return []
    pitfalls = []
    tag = _build_tag(torch_version)
    index = f" --index-url https://download.pytorch.org/whl/{tag}" if tag else ""
    expected = expected_torchvision_minor(torch_version)
    vision = _release(vision_version)
    if expected is not None and vision[:2] != (0, expected):
        pitfalls.append(
            Pitfall(
                "torch-torchvision-version",
                "error",
                f"torchvision {vision_version} does not go with torch {torch_version} (it "
                f"needs torchvision 0.{expected}): importing torchvision fails or its "
                "operators are missing ('operator torchvision::nms does not exist')",
                f'pip install "torchvision==0.{expected}.*"{index}',
            )
        )
    vision_tag = _build_tag(vision_version)
    if tag and vision_tag and tag != vision_tag:
        pitfalls.append(
            Pitfall(
                "torch-torchvision-build",
                "error",
                f"torch {torch_version} and torchvision {vision_version} are different "
                f"builds ({tag} vs {vision_tag}): torchvision's compiled operators fail to load",
                "reinstall torchvision from torch's index: pip install --force-reinstall "
                f'"torchvision=={vision_version.partition("+")[0]}"{index}',
            )
        )
    return pitfalls


def check_onnxruntime_variants(packages: Mapping[str, str]) -> list[Pitfall]:
    """onnxruntime, onnxruntime-gpu, -directml... all install the `onnxruntime` package:
    with two installed, whichever was installed last wins, file by file."""
    installed = [name for name in ONNXRUNTIME_VARIANTS if name in packages]
    if len(installed) < 2:
        return []
    listed = ", ".join(f"{name} {packages[name]}" for name in installed)
    return [
        Pitfall(
            "onnxruntime-shadowed",
            "error",
            f"{listed} are all installed and share the `onnxruntime` import package: "
            "which one runs is an accident of install order (execution providers go "
            "missing, or the import fails)",
            f"pip uninstall -y {' '.join(installed)}, then pip install the one you need",
        )
    ]


def check_cuda_toolkit(torch_cuda: str | None, nvcc_cuda: str | None) -> list[Pitfall]:
    """torch.utils.cpp_extension refuses an nvcc of another CUDA major version than torch's,
    and warns about another minor version."""
    if not torch_cuda or not nvcc_cuda:
        return []
    torch_release, nvcc_release = _release(torch_cuda)[:2], _release(nvcc_cuda)[:2]
    if torch_release == nvcc_release:
        return []
    fix = (
        f"install CUDA toolkit {torch_cuda} and point CUDA_HOME at it, or install the torch "
        f"build for CUDA {nvcc_cuda}"
    )
    if torch_release[:1] != nvcc_release[:1]:
        message = (
            f"nvcc is CUDA {nvcc_cuda} but torch was built with CUDA {torch_cuda}: building "
            "the bladesmith CUDA operators fails (different major version)"
        )
        return [Pitfall("nvcc-cuda-major", "error", message, fix)]
    message = (
        f"nvcc is CUDA {nvcc_cuda} but torch was built with CUDA {torch_cuda}: the operators "
        "build, with a warning, and usually work"
    )
    return [Pitfall("nvcc-cuda-minor", "warning", message, fix)]


def check_build_tools(toolchain: Toolchain, cuda_gpus: int) -> list[Pitfall]:
    """Missing build tools are errors while the operator library still has to be built."""
    ops = toolchain.ops
    severity = "warning" if ops.built else "error"
    pitfalls = []
    if ops.built and ops.loadable is False:
        pitfalls.append(
            Pitfall(
                "ops-not-loadable",
                "error",
                f"the bladesmith operator library {ops.path} is built but does not load: "
                f"{ops.detail}",
                "rebuild it with `bladesmith ops build` (it may have been built for another torch)",
            )
        )
    if toolchain.compiler.path is None:
        fix = (
            'run from an "x64 Native Tools Command Prompt for VS" (cl must be on PATH)'
            if _IS_WINDOWS
            else "install g++ (e.g. apt install g++) or set CXX to your compiler"
        )
        message = f"no C++ compiler to build the bladesmith operators: {toolchain.compiler.detail}"
        pitfalls.append(Pitfall("no-cxx-compiler", severity, message, fix))
    if toolchain.ninja.path is None:
        pitfalls.append(
            Pitfall(
                "no-ninja",
                severity,
                f"torch builds C++ extensions with ninja: {toolchain.ninja.detail}",
                "pip install ninja, and activate the environment so its scripts are on PATH",
            )
        )
    if cuda_gpus and toolchain.torch_cuda and toolchain.nvcc.path is None:
        pitfalls.append(
            Pitfall(
                "no-nvcc",
                "warning",
                f"a CUDA GPU is here but no nvcc ({toolchain.nvcc.detail}): the bladesmith "
                "operators cannot be built with their CUDA kernels",
                f"install CUDA toolkit {toolchain.torch_cuda} and set CUDA_HOME to it",
            )
        )
    return pitfalls
