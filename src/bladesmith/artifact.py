"""The optimized artifact: in memory (``OptimizedModule``) and on disk (``save``/``load``).

``save`` writes what the optimized module computes, without Python code, in the format
its suffix names (``runtimes.formats.FORMATS``) with
bladesmith's metadata (device, output form, spec), so that ``load`` gives back the same
call and output structure; the user's operator libraries it calls go beside it
(``<artifact>.libs/``, recorded by SHA-256), and both replace the previous ones together.
``load`` never unpickles (``docs/security.md``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from bladesmith.devices import moved_to
from bladesmith.errors import BladesmithError
from bladesmith.families import Family, family_named
from bladesmith.ops import libraries
from bladesmith.runtimes import aoti, formats, torchscript
from bladesmith.runtimes.built_for import BuiltFor, Checked, one_per_signature
from bladesmith.runtimes.torchscript import guarded
from bladesmith.spec import Spec
from bladesmith.typed_outputs import Rebuild


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
        # example's batch): it refuses others (runtimes/built_for.py)...
        self.batch_fixed = bool(batch_fixed)
        # ...and those of ``batches``, a .pt2's that holds a model for each (the spec's
        # other dimensions and dtypes; what serving can fill as buckets).
        self.batches = tuple(sorted(batches))
        self.device = torch.device(device)
        self.family = family
        self.output = output
        self.spec = spec
        self.candidate = candidate  # the engine's Candidate; None for a loaded artifact
        self.example_args = example_args  # inputs in the fast path's form, for save()
        # The test inputs it was verified at, in that form, one per input signature, the
        # example's first: save compiles a .pt2's models and checks its file at each.
        calls = [example_args, *verified_args] if example_args is not None else []
        self.verified_args = one_per_signature(calls)
        # Registered, so that parameters() and state_dict() show the weights.
        self.module = candidate.module if candidate is not None else None
        self._user_form = family.user_form(self._run) if family is not None else None
        # What runs returns plain containers: the model's own types are put back.
        types = spec.output_types if spec is not None else None
        self._typed = Rebuild(types) if types else None
        # {suffix: the optimized module that ``save`` writes in that format} where it is
        # not this one: a detector's module saved through its fixed-shape pipeline.
        self.saved_forms: dict[str, OptimizedModule] = {}

    @classmethod
    def from_candidate(
        cls, candidate, *, spec=None, output="native", example_args=None, verified_args=()
    ):
        run, built_for = guarded(candidate, spec, example_args)
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

    def runtime_settings(self) -> dict:
        """How it runs here, after a call: its runtime's own settings where it has them
        (OpenVINO's hint, threads, streams and precision), else torch's intra-op threads
        (which the TorchScript, ONNX Runtime and compiled formats use)."""
        runners = getattr(self._run, "runs", {None: self._run}).values()  # Checked: several
        for runner in runners:
            used = runner.used() if callable(getattr(runner, "used", None)) else None
            if used:
                return used
        return {"threads": torch.get_num_threads()}

    def as_padded(self) -> OptimizedModule:
        """The same optimized module returning its family's padded tensors (a detector:
        ``forward(images [B, 3, H, W] or list) -> (boxes [B, D, 4], scores [B, D], labels
        [B, D] int64, num_detections [B] int64)``, slots past num_detections padding: score
        0, label -1). One fixed shape, no host synchronisation: for serving and capture."""
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
        args, kwargs = moved_to(self.device, (args, kwargs))
        with torch.no_grad():
            if self.family is None:
                outputs = self._run(*args, **kwargs)
                return self._typed(outputs) if self._typed is not None else outputs
            if self.output == "padded":
                return self._run(*self.family.pipeline_args(args))
            return self._user_form(*args)

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
        if torchscript.SUFFIX not in spec.save_formats:
            why = spec.refused_formats.get(torchscript.SUFFIX, "TorchScript was not verified")
            formats = ", ".join(spec.save_formats) or "none"
            raise BladesmithError(
                f"torch.jit.save: this optimized module cannot be saved as TorchScript ({why}); "
                f"use bladesmith.save(optimized, path) with a path ending in: {formats}"
            )
        write(self, Path(path), torchscript.SUFFIX)

    def _apply(self, fn, recurse=True):
        raise BladesmithError(
            f"an optimized module is fixed to {self.device} and the dtypes it was "
            "optimized for (its compiled kernels and CUDA graphs would be stale); "
            "optimize the original model again for another device or dtype"
        )

    def extra_repr(self) -> str:
        backend = self.spec.backend if self.spec else "loaded"
        return f"device={self.device}, backend={backend}, output={self.output}"


def save(optimized: OptimizedModule, path: str | os.PathLike, *, inductor_configs=None) -> Path:
    """Write ``optimized`` (from ``bladesmith.optimize``) to ``path`` and return it.

    The suffix picks the format (``runtimes.formats.FORMATS``; ``inductor_configs``,
    e.g. ``{"max_autotune": True}``, go to a ``.pt2``'s AOTInductor). ``spec.save_formats``
    lists those optimize saved, loaded and verified, the one closest to what runs in
    memory first; one of ``spec.untried_formats`` is checked in a new process on a test
    input of each signature, and deleted with the reason when it differs; one of
    ``spec.refused_formats`` is refused with its reason.
    """
    from bladesmith.fresh_load import reload_problem

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
        known = ", ".join(f"{suffix} ({formats.FORMATS[suffix].description})" for suffix in allowed)
        raise BladesmithError(f"save: path {str(path)!r} must end with one of: {known}")
    write(optimized, path, inductor_configs=inductor_configs)
    if path.suffix in spec.untried_formats:
        problem = reload_problem(optimized.saved_forms.get(path.suffix, optimized), path)
        if problem is not None:
            path.unlink(missing_ok=True)
            shutil.rmtree(libraries.folder_beside(path), ignore_errors=True)
            raise BladesmithError(f"save: {path} was not kept: {problem}")
    return path


def write(optimized: OptimizedModule, path: Path, form: str = "", *, inductor_configs=None) -> None:
    """Write ``optimized`` in format ``form`` (a suffix; default ``path``'s), unchecked."""
    from bladesmith.config import Config

    form = form or path.suffix
    optimized = optimized.saved_forms.get(form, optimized)
    module, calls = optimized.candidate.module, optimized.verified_args
    options = {
        "inductor_configs": inductor_configs,
        "progress": Config.current().progress,
        "runner": optimized.candidate.runner,
    }
    formats.write(module, calls, path, _metadata(optimized), form, **options)


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


def load(path: str | os.PathLike, *, trust: bool = False) -> OptimizedModule:
    """The artifact ``save`` wrote, as a module with the optimized module's call and
    outputs. Its metadata is read first, without loading the model; then bladesmith's
    custom operators and the libraries it records, checked, then the model.

    What would run code the file brings (its operator libraries, a ``.pt2``'s compiled
    code, TorchScript outside the operator allowlist) is refused in one line unless
    ``trust`` (the command line's ``--trust``): only for files from someone you trust
    (docs/security.md)."""
    path = Path(path)
    info = formats.metadata_of(path)
    run = formats.read(path, info, trust=trust)
    spec = Spec.from_dict(info["spec"])
    runs = run if isinstance(run, dict) else {}  # a .pt2's models, by what each runs
    built_for = BuiltFor.of(spec, **info["inputs"]) if "inputs" in info and not runs else None
    if built_for is not None:
        runs = {built_for: run}
    return OptimizedModule(
        Checked(runs, str(path)) if runs else run,
        device=info["device"],
        family=family_named(info["family"]) if info.get("family") else None,
        output=info["output"],
        spec=spec,
        batch_fixed=any(not b.free_batch for b in runs),
        batches=aoti.batches_held(runs, spec) if "models" in info else (),
    )
