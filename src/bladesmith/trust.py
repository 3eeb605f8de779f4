"""The one gate for running what a file brings (docs/security.md, "Trust model").

A file whose loading would run code its maker wrote (a native library, compiled
AOTInductor code, TorchScript outside the operator allowlist, a pickle) is refused in one
line naming the file, what would run and the flag, unless the user said ``--trust``
(Python: ``trust=True``); then the reason is printed on stderr before it runs.
"""

from __future__ import annotations

import os
import sys

from bladesmith.errors import BladesmithError

FLAG = "--trust"
HOW = f"pass {FLAG} (Python: trust=True)"
# ``trust`` without the notice: for a file whose trust the process that started this one
# has already announced.
QUIET = "quiet"
# ``trust`` without any notice of loading (the trust, a program that compiles again): for
# a file this process has just written to check it, under a name the user never sees.
WRITTEN_HERE = "written here"


class UntrustedFileError(BladesmithError):
    """Loading the file would run code its maker wrote, and ``--trust`` was not given."""


def require(
    path: str | os.PathLike, what_runs: str, trust: bool | str, source: str = "load"
) -> None:
    """Refuse ``path`` in one line unless ``trust``: loading it runs ``what_runs`` (a
    phrase: "the native library .libs/x.so"); when trusted, say so on stderr first
    (unless ``trust`` is ``QUIET`` or ``WRITTEN_HERE``)."""
    if not trust:
        raise UntrustedFileError(
            f"{source}: {str(path)!r} would run {what_runs}, which its maker wrote: refused; "
            f"if you trust who made this file, {HOW}"
        )
    if trust not in (QUIET, WRITTEN_HERE):
        print(f"bladesmith: trusting {str(path)!r}: running {what_runs}", file=sys.stderr)
