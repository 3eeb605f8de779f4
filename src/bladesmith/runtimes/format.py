"""The format contract: what a saved format is and does. Each ``runtimes/<format>.py``
fills it once (a subclass and its one instance, ``FORMAT``) and ``formats.FORMATS``
lists them; whatever asks which formats exist, which one a result may be saved in, how
a file is written and read, or which Triton backend serves it asks the format, so a new
runtime is its module, one line in ``FORMATS`` and its pass.

As NNCF's backends do, a format that leaves a duty unfilled fails early: a missing
class attribute when its class is defined, a missing method when it is created.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import ClassVar, Literal

BuildCost = Literal["seconds", "minutes"]

_DECLARED = (
    "suffix",
    "description",
    "devices",
    "build_cost",
    "zip_archive",
    "needs_fake_kernels",
    "triton_backend",
)


class Format(abc.ABC):
    suffix: ClassVar[str]  # the file's suffix, which picks the format (".pt")
    description: ClassVar[str]  # one line: what the file holds and what runs it
    devices: ClassVar[tuple[str, ...]]  # device kinds a file of it is written and checked on
    # "minutes": left untried during optimize (bladesmith.save builds it and checks it).
    build_cost: ClassVar[BuildCost]
    zip_archive: ClassVar[bool]  # the file is a ZIP archive (checked before its reader runs)
    needs_fake_kernels: ClassVar[bool]  # its writer traces the operators on fake tensors
    # Triton's backend that runs the file as it is; None: only bladesmith's Python model.
    triton_backend: ClassVar[str | None]
    # Device kinds on which it is the first choice among the formats a result verifies in.
    first_on: ClassVar[tuple[str, ...]] = ()
    # It holds only a runner its own pass built (``Pass.saves_as``): a result that runs
    # anything else is not saved in it.
    only_its_pass: ClassVar[bool] = False
    # Where writing it compiles the model: what the build does, which the report gives
    # beside its build time during optimize (None: writing it is a conversion).
    build_note: ClassVar[str | None] = None
    # The package its reader needs beyond bladesmith's own dependencies (None: none).
    package: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [name for name in _DECLARED if not hasattr(cls, name)]
        if missing:
            raise TypeError(f"format {cls.__name__} does not declare {', '.join(missing)}")

    def refuses(self, module, device) -> str | None:
        """Why no result of ``module`` (the model as given) on ``device`` can be saved in
        this format, or None (then each result is written, loaded back and checked)."""
        if device.type not in self.devices:
            return (
                f"bladesmith writes and checks a saved {self.suffix} on "
                f"{' or '.join(self.devices)} only: optimize with device='{self.devices[0]}' "
                "for one"
            )
        return None

    def refuses_operators(self, operators) -> str | None:
        """Why a model calling the user's ``operators`` ("ns::name") cannot be saved in
        this format, naming them, or None."""
        return None

    def missing_package(self) -> str | None:
        """One line naming what to install when ``package`` is needed and absent."""
        if self.package is None:
            return None
        import importlib.util

        module = self.package.split("[")[0]
        if importlib.util.find_spec(module) is None:
            return (
                f"{self.suffix} needs the {module} package, which is not installed: "
                f"pip install 'bladesmith[{module}]'"
            )
        return None

    @abc.abstractmethod
    def write(self, module, calls: list[tuple], path: Path, metadata: dict, *, key: str, **options):
        """Write ``module`` (what the result computes), built on ``calls`` (its verified
        inputs, one per signature, the example's first), at ``path``; complete
        ``metadata`` with what the reader needs and store it under ``key``. ``options``:
        ``name`` (the file's, for progress), ``progress``, ``runner`` (what the result
        runs) and the format's own."""

    @abc.abstractmethod
    def metadata(self, path: Path, key: str) -> str | None:
        """bladesmith's metadata (JSON, under ``key``) read without loading the model;
        None where the file has none."""

    @abc.abstractmethod
    def read(self, path: Path, info: dict, trust: bool = False):
        """The runner of the file (or {BuiltFor: runner} for a file of several models);
        ``info``: its metadata. What would run code the file brings is refused unless
        ``trust`` (``bladesmith.trust.require``)."""
