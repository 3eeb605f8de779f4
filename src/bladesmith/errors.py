"""Errors that bladesmith raises on purpose; the CLI prints them without a traceback."""


class BladesmithError(Exception):
    """Base class: a problem the user can act on, described in the message."""


class DeviceUnavailableError(BladesmithError, RuntimeError):
    """The device asked for does not exist here; the message names what is missing."""


class NotAnArtifactError(BladesmithError):
    """A model file that bladesmith.save did not write (no bladesmith metadata)."""


class MissingFileError(BladesmithError, FileNotFoundError):
    """A file bladesmith was asked to read does not exist."""


class OpsBuildError(BladesmithError, RuntimeError):
    """The custom-operator library could not be built or loaded; names the missing tool."""


_MAX_ERROR_CHARS = 400


def describe(error: BaseException) -> str:
    """One line for a report: the error's type and message, cut at 400 characters."""
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


class ModelRunError(BladesmithError):
    """The model as given failed on its test inputs (a wrong input size, say)."""
