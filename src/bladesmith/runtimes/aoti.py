"""AOTInductor: ``.pt2`` packages of compiled models, one per input signature (shapes
and dtypes) of the test data, each compiled for its fixed shapes; the default on a GPU.

Read with torch's C++ package loader alone: its Python reader would also unpickle
whatever torch.export program a crafted file carries (``pt2_archive``). The package is
compiled code, which loading runs: a ``.pt2`` is trusted as a shared library is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from bladesmith.onnx.exporter import baked_arguments
from bladesmith.progress import Progress
from bladesmith.runtimes import pt2_archive
from bladesmith.runtimes.built_for import BuiltFor, describe_tensors, signature
from bladesmith.runtimes.format import Format
from bladesmith.spec import Spec
from bladesmith.trust import require

SUFFIX = ".pt2"
# torch's refusal of a package built for a device this machine lacks.
DEVICE_ERROR = "Cannot load AOTInductor package for device"


def write(
    module, calls: list[tuple], path: Path, metadata: dict, *, key: str, name: str, **options
) -> None:
    """An AOTInductor package of one model of ``module`` per input signature of ``calls``,
    each compiled for its shapes; the first is torch's default, "model" (what
    ``aoti_load_package`` loads). Every model carries the metadata (under ``key``), which
    names them; ``name``: the file's, as the steps show it. ``options``: AOTInductor's
    (``inductor_configs``) and ``progress``."""
    from torch._inductor.package import package_aoti

    several = len(calls) > 1
    why = f"AOTInductor compiled {'one model for each of' if several else 'it for'} these shapes"
    signatures = [signature(args) for args in calls]
    models = [f"model_{i}" if i else "model" for i in range(len(calls))]
    # "inputs" (the spec's, the first signature's) is what "model" alone runs: what a
    # bladesmith that predates "models" loads and checks.
    metadata["inputs"] = {"free_batch": False, "why": why}
    metadata["models"] = [
        {
            "name": name,
            "shapes": [shape for shape, _ in each],
            "dtypes": [dtype for _, dtype in each],
            # AOTInductor keeps no guard on them: the loader checks each call's.
            "constants": baked_arguments(module, args),
        }
        for name, each, args in zip(models, signatures, calls)
    ]
    progress = Progress(options.pop("progress", None))
    options = {
        **(options.get("inductor_configs") or {}),
        "aot_inductor.package": True,
        "aot_inductor.metadata": {key: json.dumps(metadata)},
    }
    files = {}
    for number, (model, args, each) in enumerate(zip(models, calls, signatures), 1):
        step = f"saving {name}: AOTInductor compiling for {describe_tensors(each)}"
        with progress.step(f"{step} ({number} of {len(calls)})" if several else step):
            exported = torch.export.export(module, args, strict=False)
            # What aoti_compile_and_package compiles, kept apart to package several.
            files[model] = torch._inductor.aot_compile(
                exported.module(check_guards=False), args, options=options
            )
    package_aoti(str(path), files)


def metadata(path: Path, key: str) -> str | None:
    """bladesmith's metadata (under ``key``), read without loading the package."""
    return pt2_archive.aoti_metadata(path, key)


def read(path: Path, info: dict, trust: bool = False) -> dict[BuiltFor, Callable] | Callable:
    """The package's models, each by what it runs (``info``: its metadata); a package
    without "models" (older bladesmith) is its one model, "model". Its compiled code runs
    as it loads: only when ``trust``."""
    require(path, "the compiled AOTInductor code it holds (a shared library)", trust)
    if "models" not in info:
        return _model(path, "model")
    why = info["inputs"]["why"]
    return {_compiled_for(each, why): _model(path, each["name"]) for each in info["models"]}


def _model(path: Path, name: str) -> Callable:
    """One model of the package, loaded by torch's C++ loader (no pickle read)."""
    from torch._inductor.package.package import AOTICompiledModel

    return AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(str(path), name, False, 1, -1))


def _compiled_for(model: dict, why: str) -> BuiltFor:
    """What a .pt2's model (its metadata's entry) runs: tensors of its shapes and dtypes."""
    constants = json.dumps(model["constants"]) if model.get("constants") else ""
    shapes, dtypes = tuple(map(tuple, model["shapes"])), tuple(model["dtypes"])
    return BuiltFor(shapes, dtypes, False, why, constants=constants)


def batches_held(runs, spec: Spec) -> set[int]:
    """The batch sizes a .pt2 holds a model for at the spec's other dimensions and
    dtypes, without constants to hold."""
    shapes, dtypes = tuple(map(tuple, spec.input_shapes)), tuple(spec.input_dtypes)
    return {
        built.shapes[0][0]
        for built in runs
        if built.dtypes == dtypes
        and not built.constant_arguments
        and len(built.shapes) == len(shapes)
        and all(shape[1:] == want[1:] for shape, want in zip(built.shapes, shapes))
        and all(shape and shape[0] == built.shapes[0][0] for shape in built.shapes)
    }


class AOTInductor(Format):
    suffix = SUFFIX
    description = "AOTInductor package (torch.export + AOTInductor, a model per input shape)"
    devices = ("cuda", "cpu")
    build_cost = "minutes"
    zip_archive = True
    needs_fake_kernels = True  # torch.export traces the operators on fake tensors
    triton_backend = None
    first_on = ("cuda",)

    def refuses(self, module, device) -> str | None:
        from bladesmith.runtimes.torchscript import is_torchscript

        if is_torchscript(module):
            return "a TorchScript model does not go through torch.export"
        return None

    def refuses_operators(self, operators) -> str | None:
        from bladesmith.ops import libraries

        lacking = libraries.without_fake_kernel(operators)
        if lacking:
            return (
                f"torch.export cannot trace {', '.join(lacking)} (no fake kernel; "
                "torch.library.register_fake gives one)"
            )
        return None

    write = staticmethod(write)
    metadata = staticmethod(metadata)
    read = staticmethod(read)


FORMAT = AOTInductor()
