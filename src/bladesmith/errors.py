"""Errors that bladesmith raises on purpose; the CLI prints them without a traceback."""

import contextlib
import logging
import re


class BladesmithError(Exception):
    """Base class: a problem the user can act on, described in the message."""

    exit_code = 2  # the CLI's exit status for it: bad input (a file, a flag)


class DeviceUnavailableError(BladesmithError, RuntimeError):
    """The device asked for does not exist here; the message names what is missing."""


class NotAnArtifactError(BladesmithError):
    """A model file that bladesmith.save did not write (no bladesmith metadata)."""


class MissingFileError(BladesmithError, FileNotFoundError):
    """A file bladesmith was asked to read does not exist."""


class SettingError(BladesmithError, ValueError, TypeError):
    """A setting of ``Config`` (or a flag that sets one) of the wrong type or out of range;
    the message names it and what it takes (a ValueError and a TypeError too, as Python
    raises either for a bad argument)."""


class OpsBuildError(BladesmithError, RuntimeError):
    """The custom-operator library could not be built or loaded; names the missing tool."""


_MAX_ERROR_CHARS = 400


@contextlib.contextmanager
def quiet_log(name: str, level: int = logging.CRITICAL):
    """The logger ``name`` (torch's) passing only records of ``level`` and above
    meanwhile; by default critical ones only: it logs a failure with its traceback
    before raising it, and the error raised is what bladesmith reports, in one line."""
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


def describe(error: BaseException) -> str:
    """One line for a report: the error's type and message, cut at 400 characters (tensor
    values elided)."""
    text = one_line(said(error))
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def said(error: BaseException) -> str:
    """ "Type: message" of ``error``; of one without a message (torch raises some), also
    the first error it was raised from that has one: "RuntimeError with no message,
    raised from ValueError: ..."."""
    if str(error).strip():
        return f"{type(error).__name__}: {error}"
    text = f"{type(error).__name__} with no message"
    seen, cause = {id(error)}, error.__cause__ or error.__context__
    while cause is not None and id(cause) not in seen:
        if str(cause).strip():
            return f"{text}, raised from {type(cause).__name__}: {cause}"
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return text


def one_line(text: str) -> str:
    """``text`` (an error's message) on one line: a TorchScript stack inside it replaced by
    the error it ends with, tensor values elided, a kernel's source location left out,
    whitespace runs made one space."""
    text = _SOURCE_LOCATION.sub("", without_values(fold_torchscript(text)))
    return " ".join(text.split())


# Where a C++ kernel raised, on the machine that built it: 'operator(),
# /__w/vision/vision/.../nms_kernel.cpp:122, "nms_kernel" not implemented for ...'.
_SOURCE_LOCATION = re.compile(r"\b[\w:~<>]+\(\), /\S+:\d+, ")


_TORCHSCRIPT_STACK = "The following operation failed in the TorchScript interpreter"
# The error a TorchScript stack ends with: the first line at the margin naming one (the
# stack's code lines are indented).
_STACK_END = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception):[ \t]*(.*)$", re.MULTILINE)


def fold_torchscript(text: str) -> str:
    """``text`` with a TorchScript interpreter's stack (``The following operation failed
    in the TorchScript interpreter. Traceback of TorchScript ...``, dozens of lines of
    code) replaced by the message of the error it ends with."""
    start = text.find(_TORCHSCRIPT_STACK)
    if start < 0:
        return text
    end = _STACK_END.search(text, start)
    if end is None:
        return text
    cause = end.group(1).strip() or "TorchScript gave no message"
    rest = text[end.end() :]
    if rest.lstrip().startswith((")", ".", ",", ";")):  # what wrapped it goes on
        rest = rest.lstrip()
    return text[:start] + cause + rest


def without_values(text: str) -> str:
    """``text`` with each printed tensor (``tensor([[0.1, ...]])``, which torch's tracer
    puts in its messages, many lines of them) shortened to ``tensor(...)``."""
    parts, start = [], 0
    while (found := text.find("tensor(", start)) >= 0:
        depth, end = 0, found + len("tensor")
        for end in range(found + len("tensor"), len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        parts.append(text[start:found] + "tensor(...)")
        start = end + 1
    return "".join(parts) + text[start:]


class ModelRunError(BladesmithError):
    """The model as given failed on its test inputs (a wrong input size, say)."""


class StatefulModelError(BladesmithError):
    """Calling the model changes its own parameters or buffers (a counter, batch norm
    statistics): its outputs depend on how often it ran, so they cannot be verified."""
