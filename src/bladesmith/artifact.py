"""The optimized artifact: in memory (``OptimizedModule``) and on disk (``save``/``load``).

``save`` writes what the optimized module computes, without Python code:
- ``.pt2``: an AOTInductor package (``torch.export`` of the fixed-shape module, then
  AOTInductor) of one model per input signature (shapes and dtypes) of the test data,
  each compiled for its fixed shapes, the default on a GPU;
- ``.pt``: frozen TorchScript (``torch.jit.trace`` + ``torch.jit.freeze``);
- ``.onnx``: ONNX for ONNX Runtime on the CPU (what the onnxruntime pass runs).
All keep bladesmith's metadata (device, output form), so ``load`` gives back the same
call signature and output structure. Files are written to a temporary name beside the
target, then renamed: a crash never leaves half a file. Custom operators are loaded
(``bladesmith.ops.load_library()``) before the artifact, which refers to them by name.
The user's operator libraries that the model calls (``ops/libraries.py``) are copied
into ``<artifact>.libs/`` beside it and loaded again by ``load``; a format that needs
operators to run on fake tensors (``.pt2``) is refused for those that cannot.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils import _pytree as pytree

from bladesmith._files import contents, first_line, unreadable, write_atomically
from bladesmith.bench import iter_tensors
from bladesmith.devices import with_index
from bladesmith.errors import BladesmithError, MissingFileError, NotAnArtifactError
from bladesmith.families import Family, family_named
from bladesmith.onnx.exporter import baked_arguments
from bladesmith.ops import libraries
from bladesmith.runtimes.built_for import (
    BuiltFor,
    Checked,
    describe_tensors,
    follows_the_batch,
    signature,
)
from bladesmith.runtimes.onnxruntime import cpu_runner, export_for_any_batch
from bladesmith.runtimes.torchscript import freeze, is_torchscript, quiet_torchscript
from bladesmith.spec import AOTI_SUFFIX, SAVE_FORMATS, TORCHSCRIPT_SUFFIX, Spec

METADATA_KEY = "bladesmith"  # AOTInductor metadata key / TorchScript extra file stem
_TORCHSCRIPT_EXTRA = f"{METADATA_KEY}.json"


class OptimizedModule(nn.Module):
    """A drop-in replacement for the model given to ``optimize``: same call, same
    output structure. Inputs are moved to the module's device; grad is off.

    For a model of a known family (``family``, e.g. a detector) the fast path is the
    family's fixed-shape pipeline, from a batch [B, 3, H, W] to padded tensors;
    ``output="native"`` returns the model's own structure (``Family.to_user``: a
    detector's list of {boxes, scores, labels} dicts) from the model's call (a list of
    images, or a batch), ``output="padded"`` the padded tensors themselves (see
    ``as_padded``).

    The module is fixed to the device, dtype and input shapes it was optimized for:
    converting it (``.to``, ``.half``, ...) is refused; optimize again instead.
    ``spec`` describes it; ``bladesmith.save`` writes it to disk.
    """

    def __init__(
        self,
        run: Callable,
        *,
        device: torch.device | str,
        family: Family | None = None,
        output: str = "native",
        spec: Spec | None = None,
        candidate=None,
        example_args: tuple | None = None,
        verified_args: Sequence[tuple] = (),
        batch_fixed: bool = False,
        batches: Sequence[int] = (),
    ):
        super().__init__()
        self._run = run
        # Runs at its spec's batch only (an AOTInductor package; a trace that keeps its
        # example's batch): it refuses others (runtimes/inputs.py)...
        self.batch_fixed = bool(batch_fixed)
        # ...and those of ``batches``, a .pt2's that holds a model for each (the spec's
        # other dimensions and dtypes; what serving can fill as buckets).
        self.batches = tuple(sorted(batches))
        self.device = torch.device(device)
        self._home = with_index(self.device)  # as tensors report it
        self.family = family
        self.output = output
        self.spec = spec
        self.candidate = candidate  # the engine's Candidate; None for a loaded artifact
        self.example_args = example_args  # inputs in the fast path's form, for save()
        # The test inputs it was verified at, in that form, one per input signature, the
        # example's first: save compiles a .pt2's models and checks its file at each.
        calls = [example_args, *verified_args] if example_args is not None else []
        self.verified_args = _one_per_signature(calls)
        # Registered, so that parameters() and state_dict() show the weights.
        self.module = candidate.module if candidate is not None else None
        self._user_form = family.user_form(self._run) if family is not None else None

    @classmethod
    def from_candidate(
        cls, candidate, *, spec=None, output="native", example_args=None, verified_args=()
    ):
        # The model as given (nothing applied) runs as its own forward, through nothing.
        untouched = not candidate.applied and candidate.runner is None
        run = candidate.module if untouched else candidate
        built_for, source = None, "images"
        if candidate.family is not None and spec is not None:
            # Its trace or graph has no size check (Python's is not traced): images of
            # another size or dtype would be resized and normalised as if of its own.
            why = "its fixed-shape pipeline was built for images of this size"
            built_for = BuiltFor.of(spec, free_batch=True, why=why)
        elif spec is not None and _is_trace(candidate.runner):
            # A trace that keeps its example's batch answers others wrongly: refused as
            # its .pt is. One that follows the batch is left free: it was verified on
            # every size of the test data, which its .pt (checked at one) is not.
            inputs = _traced_inputs(candidate.runner, candidate.module, example_args)
            if not inputs["free_batch"]:
                built_for, source = BuiltFor.of(spec, **inputs), "optimized module"
        if built_for is not None:
            run = Checked({built_for: run}, source)
        return cls(
            run,
            device=candidate.device,
            family=candidate.family,
            output=output,
            spec=spec,
            candidate=candidate,
            example_args=example_args,
            verified_args=verified_args,
            batch_fixed=built_for is not None and not built_for.free_batch,
        )

    def as_padded(self) -> OptimizedModule:
        """The same optimized module returning its family's padded tensors (a detector:
        ``forward(images [B, 3, H, W] or list) -> (boxes [B, D, 4], scores [B, D],
        labels [B, D] int64, num_detections [B] int64)``; slots past num_detections are
        padding, score 0, label -1). One fixed shape and no host synchronisation: for
        serving and capture."""
        if self.family is None:
            raise BladesmithError(
                "as_padded(): this optimized module has no padded form (no family of "
                "bladesmith.families recognised the model)"
            )
        return type(self)(
            self._run,
            device=self.device,
            family=self.family,
            output="padded",
            spec=self.spec,
            candidate=self.candidate,
            example_args=self.example_args,
            verified_args=self.verified_args,
        )

    def forward(self, *args, **kwargs):
        if not _all_on(self._home, (args, kwargs)):
            args, kwargs = pytree.tree_map(self._to_device, (args, kwargs))
        with torch.no_grad():
            if self.family is None:
                return self._run(*args, **kwargs)
            if self.output == "padded":
                return self._run(*self.family.pipeline_args(args))
            return self._user_form(*args)

    def _to_device(self, value):
        if isinstance(value, torch.Tensor) and value.device != self.device:
            return value.to(self.device)
        return value

    def save(self, path, _extra_files=None) -> None:
        """What ``torch.jit.save(optimized, path)`` calls, as code written for PAI-Blade
        does: the frozen TorchScript file ``bladesmith.save`` writes (``torch.jit.load``
        reads it), where saving it as TorchScript was verified; else an error naming
        ``bladesmith.save`` and the formats that apply."""
        spec = self.spec
        if self.candidate is None or spec is None:
            raise BladesmithError(
                "torch.jit.save: a loaded artifact is already saved: copy its file"
            )
        if _extra_files:
            raise BladesmithError("torch.jit.save: _extra_files are not kept; bladesmith.save")
        if TORCHSCRIPT_SUFFIX not in spec.save_formats:
            why = spec.refused_formats.get(TORCHSCRIPT_SUFFIX, "TorchScript was not verified")
            formats = ", ".join(spec.save_formats) or "none"
            raise BladesmithError(
                f"torch.jit.save: this optimized module cannot be saved as TorchScript ({why}); "
                f"use bladesmith.save(optimized, path) with a path ending in: {formats}"
            )
        write(self, Path(path), TORCHSCRIPT_SUFFIX)

    def _apply(self, fn, recurse=True):
        raise BladesmithError(
            f"an optimized module is fixed to {self.device} and the dtypes it was "
            "optimized for (its compiled kernels and CUDA graphs would be stale); "
            "optimize the original model again for another device or dtype"
        )

    def extra_repr(self) -> str:
        backend = self.spec.backend if self.spec else "loaded"
        return f"device={self.device}, backend={backend}, output={self.output}"


def _is_trace(runner) -> bool:
    return isinstance(runner, nn.Module) and is_torchscript(runner)


def _traced_inputs(trace, module, args: tuple) -> dict:
    """What a trace of ``module`` on ``args`` runs, as ``BuiltFor.of``'s keywords: whether
    its batch is free (``follows_the_batch``), and why others are refused."""
    free = follows_the_batch(trace, module, args)
    why = "traced at these sizes" + (
        ", and checked at other batches" if free else "; at another batch it answers otherwise"
    )
    # One that keeps its batch holds only that: optimize verified it, and save checks
    # it, at every size of the test data, which the spec (the first) does not list.
    return {"free_batch": free, "why": why, "batch_only": not free}


def _one_per_signature(calls: list[tuple]) -> list[tuple]:
    """The first of ``calls`` of each input signature (shapes and dtypes, and the
    non-tensor arguments, which a .pt2's model holds as constants), in order."""
    firsts = {}
    for args in calls:
        constants = [repr(leaf) for leaf in pytree.tree_leaves(args) if not torch.is_tensor(leaf)]
        firsts.setdefault((signature(args), *constants), args)
    return list(firsts.values())


def _all_on(device: torch.device, tree) -> bool:
    """Whether every tensor in ``tree`` is on ``device`` already: the usual case, checked
    without pytree's cost on every call."""
    return all(tensor.device == device for tensor in iter_tensors(tree))


def save(optimized: OptimizedModule, path: str | os.PathLike, *, inductor_configs=None) -> Path:
    """Write ``optimized`` (from ``bladesmith.optimize``) to ``path`` and return it.

    The suffix picks the format: ``.pt2`` (AOTInductor package of one model per input
    signature, shapes and dtypes, of the test data, each compiled for its shapes: the
    time grows with their number, a spinner on a terminal names the one compiling;
    ``inductor_configs`` are passed to AOTInductor, e.g. ``{"max_autotune": True}``),
    ``.pt`` (frozen TorchScript) or ``.onnx`` (ONNX Runtime, CPU).
    ``optimized.spec.save_formats`` lists those that optimize saved, loaded and verified,
    the one closest to what runs in memory first. A format in ``spec.untried_formats`` is
    written, loaded back in a new process and compared with the optimized module at the
    spec's tolerance on a test input of each signature; when its outputs differ it is
    deleted and the error says so. A format in
    ``spec.refused_formats`` is refused with its reason.
    """
    path = Path(path)
    if not isinstance(optimized, OptimizedModule) or optimized.candidate is None:
        raise BladesmithError(
            "save: expected the module returned by bladesmith.optimize, got "
            f"{type(optimized).__name__} (a loaded artifact is already saved: copy its file)"
        )
    spec = optimized.spec
    if path.suffix in spec.refused_formats:
        raise BladesmithError(f"save: {path.suffix} refused: {spec.refused_formats[path.suffix]}")
    allowed = (*spec.save_formats, *spec.untried_formats)
    if path.suffix not in allowed:
        known = ", ".join(f"{suffix} ({SAVE_FORMATS[suffix]})" for suffix in allowed)
        raise BladesmithError(f"save: path {str(path)!r} must end with one of: {known}")
    write(optimized, path, inductor_configs=inductor_configs)
    if path.suffix in spec.untried_formats:
        problem = reload_problem(optimized, path)
        if problem is not None:
            path.unlink(missing_ok=True)
            raise BladesmithError(f"save: {path} was not kept: {problem}")
    return path


def write(optimized: OptimizedModule, path: Path, form: str = "", *, inductor_configs=None) -> None:
    """Write ``optimized`` in format ``form`` (a suffix; default ``path``'s), unchecked."""
    module, args = optimized.candidate.module, optimized.example_args
    form = form or path.suffix
    operators = libraries.operators_called(module, args)
    if form == AOTI_SUFFIX:
        _check_fake_kernels(operators, path)
    metadata = _metadata(optimized)
    metadata["libraries"] = libraries.store(libraries.libraries_of(operators), path)
    if form == AOTI_SUFFIX:
        _write_aoti(module, optimized.verified_args, path, metadata, inductor_configs)
    elif form == TORCHSCRIPT_SUFFIX:
        frozen = freeze(module, args)
        metadata["inputs"] = _traced_inputs(frozen, module, args)
        extra = {_TORCHSCRIPT_EXTRA: json.dumps(metadata)}
        with quiet_torchscript():
            write_atomically(
                path, lambda temporary: torch.jit.save(frozen, str(temporary), _extra_files=extra)
            )
    else:
        write_atomically(path, lambda temporary: _write_onnx(module, args, temporary, metadata))


def _write_aoti(module, calls: list[tuple], path: Path, metadata: dict, inductor_configs) -> None:
    """An AOTInductor package of one model of ``module`` per input signature of ``calls``,
    each compiled for its shapes; the first is torch's default, "model" (what
    ``aoti_load_package`` loads). Every model carries the metadata, which names them."""
    from torch._inductor.package import package_aoti

    from bladesmith.config import Config
    from bladesmith.progress import Progress

    several = len(calls) > 1
    why = f"AOTInductor compiled {'one model for each of' if several else 'it for'} these shapes"
    signatures = [signature(args) for args in calls]
    names = [f"model_{i}" if i else "model" for i in range(len(calls))]
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
        for name, each, args in zip(names, signatures, calls)
    ]
    options = {
        **(inductor_configs or {}),
        "aot_inductor.package": True,
        "aot_inductor.metadata": {METADATA_KEY: json.dumps(metadata)},
    }
    progress = Progress(Config.current().progress)
    files = {}
    for number, (name, args, each) in enumerate(zip(names, calls, signatures), 1):
        step = f"saving {path.name}: AOTInductor compiling for {describe_tensors(each)}"
        with progress.step(f"{step} ({number} of {len(calls)})" if several else step):
            exported = torch.export.export(module, args, strict=False)
            # What aoti_compile_and_package compiles, kept apart to package several.
            files[name] = torch._inductor.aot_compile(
                exported.module(check_guards=False), args, options=options
            )
    write_atomically(path, lambda temporary: package_aoti(str(temporary), files))


def reload_problem(optimized: OptimizedModule, path: Path) -> str | None:
    """Why the artifact at ``path`` is not ``optimized`` (it does not load and run in a
    new process, or its outputs on a test input of each signature differ past the spec's
    tolerance there), or None when it is."""
    from bladesmith.fresh_load import run_saved_each
    from bladesmith.verify import compare_outputs, detection_score_tolerance

    calls = optimized.verified_args
    outputs, problem = run_saved_each(path, calls)
    if problem is not None:
        return f"it does not load back: {problem}"
    spec = optimized.spec
    rtol, atol = spec.tolerance.get("rtol"), spec.tolerance.get("atol")
    # Detection scores as the gate judged them: what the dtype computed in may move them.
    judged_at = rtol + atol if rtol is not None and atol is not None else 0.0
    score_atol = detection_score_tolerance(getattr(torch, spec.dtype), judged_at)
    for args, got in zip(calls, outputs, strict=True):
        comparison = compare_outputs(
            optimized(*args), got, rtol=rtol, atol=atol, score_atol=score_atol
        )
        if not comparison.passed:
            at = f" at {describe_tensors(signature(args))}" if len(calls) > 1 else ""
            return f"loaded back, its outputs{at} differ: {comparison.summary()}"
    return None


def try_formats(
    optimized: OptimizedModule, formats, test_args: list[tuple], judge: Callable
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Save ``optimized`` in each of ``formats``, load it back and run it on every test
    input: (the formats whose outputs ``judge`` passes, in order; {suffix: why} for the
    others). ``judge(outputs)`` returns a ``verify.Comparison``."""
    tried, refused = [], {}
    with tempfile.TemporaryDirectory(prefix="bladesmith-save-") as directory:
        for suffix in formats:
            path = Path(directory) / f"model{suffix}"
            try:
                write(optimized, path)
                loaded = load(path)
                outputs = [loaded(*args) for args in test_args]
            except Exception as error:
                text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                refused[suffix] = f"saving it and loading it back failed ({text})"
                continue
            comparison = judge(outputs)
            if comparison.passed:
                tried.append(suffix)
            else:
                refused[suffix] = (
                    f"saved and loaded back, its outputs moved past tolerance "
                    f"({comparison.summary()})"
                )
    return tuple(tried), refused


def load(path: str | os.PathLike) -> OptimizedModule:
    """The artifact ``save`` wrote, as a module with the optimized module's call and
    outputs. bladesmith's custom operators are loaded first."""
    path = Path(path)
    problem = unreadable(path)
    if problem:
        error = MissingFileError if not path.exists() else BladesmithError
        raise error(f"load: {str(path)!r}: {problem}")
    if path.suffix not in SAVE_FORMATS:
        known = ", ".join(SAVE_FORMATS)
        raise BladesmithError(f"load: {str(path)!r} has an unknown suffix; expected {known}")
    # torch's loaders log their failures before raising: say it here, in one line.
    if path.suffix in (AOTI_SUFFIX, TORCHSCRIPT_SUFFIX) and not zipfile.is_zipfile(path):
        raise BladesmithError(
            f"load: cannot load {str(path)!r}, {contents(path)}; bladesmith.load reads what "
            "bladesmith.save wrote"
        )
    ops_error = _load_custom_ops()
    libraries.restore(path)
    models = {}  # a .pt2's, by name
    try:
        if path.suffix == AOTI_SUFFIX:
            models = _AotiModels(path)
            run = models.get("model")  # torch's default, every bladesmith .pt2's first
            metadata = run.get_metadata().get(METADATA_KEY) if run is not None else None
        elif path.suffix == TORCHSCRIPT_SUFFIX:
            extra = {_TORCHSCRIPT_EXTRA: ""}
            with quiet_torchscript():
                run = torch.jit.load(str(path), _extra_files=extra)
            metadata = extra[_TORCHSCRIPT_EXTRA] or None
        else:
            run, metadata = _read_onnx(path)
    except Exception as error:  # torch, protobuf and zipfile each raise their own
        operator = libraries.operator_error(error, path, _peek_libraries(path))
        if operator is not None:
            raise operator from None
        hint = f"; bladesmith's custom operators did not load: {ops_error}" if ops_error else ""
        raise BladesmithError(
            f"load: cannot load {str(path)!r}, {contents(path)} ({first_line(error)}){hint}; "
            "bladesmith.load reads what bladesmith.save wrote"
        ) from error
    if metadata is None:
        raise NotAnArtifactError(
            f"load: {str(path)!r} has no bladesmith metadata: it was not written by "
            "bladesmith.save (load it with torch.jit.load, aoti_load_package or "
            "bladesmith.onnx.session)"
        )
    info = json.loads(metadata)
    spec = Spec.from_dict(info["spec"])
    built_for = BuiltFor.of(spec, **info["inputs"]) if "inputs" in info else None
    runs = {built_for: run} if built_for is not None else {}
    if "models" in info:  # a .pt2 of one model per input signature (older ones: "model")
        runs = {
            _compiled_for(each, info["inputs"]["why"]): models[each["name"]]
            for each in info["models"]
        }
    if runs:
        run = Checked(runs, str(path))
    return OptimizedModule(
        run,
        device=info["device"],
        family=family_named(info["family"]) if info.get("family") else None,
        output=info["output"],
        spec=spec,
        batch_fixed=path.suffix == AOTI_SUFFIX or any(not b.free_batch for b in runs),
        batches=_batches_held(runs, spec) if "models" in info else (),
    )


def _batches_held(runs, spec: Spec) -> set[int]:
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


# torch's refusal of a package built for a device this machine lacks.
_AOTI_DEVICE_ERROR = "Cannot load AOTInductor package for device"


class _AotiModels(dict):
    """A .pt2's models by name: all read at once where torch's package reader can
    (``load_pt2``, private), else each as its public loader reads it, once asked for (a
    torch without that reader, or a package it refuses: ``load_package`` falls back the
    same way)."""

    def __init__(self, path: Path):
        self.path = str(path)
        try:
            from torch.export.pt2_archive._package import load_pt2

            super().__init__(load_pt2(self.path).aoti_runners)
        except (ImportError, RuntimeError) as error:
            if _AOTI_DEVICE_ERROR in str(error):  # built for a device that is not here
                raise
            super().__init__()
            self.__missing__("model")  # now, as before: its errors are load's

    def __missing__(self, name: str):
        from torch._inductor.package import load_package

        self[name] = load_package(self.path, model_name=name)
        return self[name]


def _compiled_for(model: dict, why: str) -> BuiltFor:
    """What a .pt2's model (its metadata's entry) runs: tensors of its shapes and dtypes."""
    constants = json.dumps(model["constants"]) if model.get("constants") else ""
    shapes, dtypes = tuple(map(tuple, model["shapes"])), tuple(model["dtypes"])
    return BuiltFor(shapes, dtypes, False, why, constants=constants)


def _check_fake_kernels(operators, path: Path) -> None:
    lacking = libraries.without_fake_kernel(operators)
    if lacking:
        raise BladesmithError(
            f"save: {path.suffix} needs torch.export, which cannot trace {', '.join(lacking)} "
            "(no fake kernel: register one with torch.library.register_fake); save as "
            f"{TORCHSCRIPT_SUFFIX} instead"
        )


def _peek_libraries(path: Path) -> list[dict]:
    """The ``libraries`` entries of a TorchScript artifact's metadata, read without
    loading the module (which fails when they are missing)."""
    import zipfile

    if path.suffix != TORCHSCRIPT_SUFFIX or not zipfile.is_zipfile(path):
        return []
    with zipfile.ZipFile(path) as archive:
        name = next(
            (n for n in archive.namelist() if n.endswith(f"/extra/{_TORCHSCRIPT_EXTRA}")), None
        )
        if name is None:
            return []
        return json.loads(archive.read(name)).get("libraries", [])


def _metadata(optimized: OptimizedModule) -> dict:
    from bladesmith import __version__

    return {
        "bladesmith_version": __version__,
        "torch_version": torch.__version__,
        "device": str(optimized.device),
        "family": optimized.family.name if optimized.family is not None else None,
        "output": optimized.output,
        "spec": optimized.spec.to_dict(),
    }


def _write_onnx(module, args: tuple, path: Path, metadata: dict) -> None:
    """Export to ONNX with bladesmith's metadata, and the output structure that
    ONNX's flat list of outputs is unflattened into."""
    import onnx

    output_spec, none_outputs, _ = export_for_any_batch(module, args, path)
    model = onnx.load(str(path))
    entry = model.metadata_props.add()
    entry.key = METADATA_KEY
    entry.value = json.dumps(
        {
            **metadata,
            "output_spec": pytree.treespec_dumps(output_spec),
            "none_outputs": list(none_outputs),
        }
    )
    onnx.save(model, str(path))


def _read_onnx(path: Path) -> tuple[Callable, str | None]:
    import onnx

    properties = onnx.load(str(path), load_external_data=False).metadata_props
    metadata = next((p.value for p in properties if p.key == METADATA_KEY), None)
    if metadata is None:
        return None, None
    info = json.loads(metadata)
    output_spec = pytree.treespec_loads(info["output_spec"])
    return cpu_runner(path, output_spec, tuple(info.get("none_outputs", ()))), metadata


def _load_custom_ops() -> Exception | None:
    """Load bladesmith's operator library, and torchvision's operators (RoIAlign, which
    R-CNN artifacts call) where torchvision is installed; the error if bladesmith's
    cannot be loaded (an artifact that needs no custom operator still loads)."""
    import contextlib

    from bladesmith.errors import OpsBuildError

    with contextlib.suppress(ImportError):
        import torchvision  # noqa: F401  (importing it registers its operators)

    try:
        from bladesmith import ops

        ops.load_library()
    except (ImportError, OpsBuildError) as error:
        return error
    return None
