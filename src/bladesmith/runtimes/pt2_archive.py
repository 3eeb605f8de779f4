"""What a ``.pt2`` archive holds, and a torch.export program read from it without pickle.

torch's reader (``load_pt2``, behind ``torch.export.load`` and ``load_package``)
unpickles a torch.export program's sample inputs, its tensor subclasses and its opaque
constants with ``weights_only=False``, and hands the program's shape expressions to
``sympy.sympify`` (Python's ``eval``): a crafted file runs any Python it likes there.
``exported_program`` reads a program with torch's own archive reader (the names torch
sees, not Python's ``zipfile``'s), accepts exactly the entries it expects (its
``untrusted`` says why not), builds the weights from their raw bytes and never reads
a pickle; ``aoti_models`` and ``member`` let ``bladesmith.load`` read an AOTInductor
package without torch's Python reader at all.
"""

from __future__ import annotations

import functools
import io
import json
import re
import zipfile
from pathlib import Path

import torch

# torch's names for the archive's parts (torch.export.pt2_archive.constants).
_MODELS = "models/"
_AOTI = "data/aotinductor/"
_SAMPLE_INPUTS = "data/sample_inputs/{}.pt"  # a pickle: never read here
# (payload config, the folder of its payloads, the raw tensors' prefix there): a
# constant of another prefix is an object torch unpickles.
_WEIGHTS = ("data/weights/{}_weights_config.json", "data/weights/", "weight_")
_CONSTANTS = ("data/constants/{}_constants_config.json", "data/constants/", "tensor_")
# What every archive torch.export.save writes holds besides its programs.
_HOUSEKEEPING = frozenset(
    {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
)
# A program's or a payload's name: a plain word (no folder, no NUL, no absolute path).
_NAME = re.compile(r"[A-Za-z0-9_]+")
_MODEL_FILE = re.compile(r"models/([A-Za-z0-9_]+)\.json")
# A shape expression (sympy.sympify's input, written by sympy's srepr:
# "Mul(Integer(2), Symbol('s39', positive=True, integer=True))"): numbers, operators,
# sympy's and torch's shape classes, their assumptions, the program's symbols (quoted or
# not) and quoted numbers; nothing else reaches eval.
_EXPRESSION_CHARACTERS = re.compile(r"[A-Za-z0-9_ +\-*/%(),.<>=!&|~]*")
_QUOTED = re.compile(r"'([^'\\]*)'|\"([^\"\\]*)\"")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SYMBOL = re.compile(r"[a-z]+[0-9]+")
_NUMBER = re.compile(r"[-+]?[0-9.]+(?:e[-+]?[0-9]+)?")
_SYMPY_NAMES = frozenset(
    {"Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs",
     "Mod", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "StrictLessThan", "LessThan",
     "StrictGreaterThan", "GreaterThan", "Equality", "Unequality", "And", "Or", "Not",
     "BooleanTrue", "BooleanFalse", "true", "false", "True", "False", "oo", "zoo", "nan",
     "Infinity", "NegativeInfinity", "One", "Zero", "NegativeOne", "Half", "floor",
     "ceiling", "Piecewise", "ExprCondPair", "ITE", "precision",
     # assumptions, as srepr writes them
     "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
     "infinite", "nonzero", "zero", "even", "odd", "rational", "commutative",
     "extended_real", "extended_positive", "extended_negative", "extended_nonnegative",
     "extended_nonpositive", "extended_nonzero"}
)  # fmt: skip


def members(path: str | Path) -> dict[str, str]:
    """The archive's member names without its root folder (torch's reader strips it),
    each to its full name in the ZIP."""
    with zipfile.ZipFile(path) as archive:
        return {name.partition("/")[2]: name for name in archive.namelist() if "/" in name}


def member(path: str | Path, name: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(members(path)[name])


def aoti_models(names) -> list[str]:
    """The AOTInductor models' names among an archive's ``members``."""
    return sorted({name[len(_AOTI) :].split("/")[0] for name in names if name.startswith(_AOTI)})


def aoti_metadata(path: str | Path, key: str) -> str | None:
    """The value of ``key`` in the metadata an AOTInductor package's first model was
    compiled with (``aot_inductor.metadata``), read from its JSON, or None."""
    names = members(path)
    prefix = f"{_AOTI}model/"
    for name in sorted(names):
        if name.startswith(prefix) and name.endswith("_metadata.json"):
            value = json.loads(member(path, name)).get(key)
            if value is not None:
                return value
    return None


class Untrusted(Exception):
    """Reading the program would run what its maker wrote, or the archive holds what
    this reader does not expect: the message says which entry."""


def exported_program(path: str | Path | io.BytesIO) -> torch.export.ExportedProgram:
    """The torch.export program in ``path`` (its first; or in the archive's bytes, a
    ``BytesIO``), read without pickle and without
    handing anything but shape arithmetic to sympy. Raises ``Untrusted`` for an archive
    that holds any entry but those torch.export.save writes for its programs (a
    compiled model, an executorch or extra file, a pickled payload), a payload outside
    its folder, or an expression that is not shape arithmetic."""
    from torch._export.serde.schema import ExportedProgram as Serialized
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass
    from torch.export.pt2_archive import _package

    with _package.PT2ArchiveReader(path if isinstance(path, io.BytesIO) else str(path)) as reader:
        names = set(reader.get_file_names())
        programs = _programs(names)
        if not programs:
            raise Untrusted("no torch.export program (models/NAME.json) in it")
        expected = set(_HOUSEKEEPING)
        for model in programs:
            expected |= _entries_of(reader, names, model)
        unexpected = sorted(names - expected)
        if unexpected:
            raise Untrusted(f"{unexpected[0]!r}: not an entry torch.export.save writes")
        model = programs[0]
        program_json = reader.read_bytes(f"{_MODELS}{model}.json")
        _check_expressions(json.loads(program_json))
        state_dict = _package._load_state_dict(reader, model)
        constants = _package._load_constants(reader, model)
    serialized = _bytes_to_dataclass(Serialized, program_json)
    # Sample inputs (a pickle) are not read: optimize has its own test data.
    return ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, None)


def _programs(names: set[str]) -> list[str]:
    """The programs' names, from their ``models/NAME.json`` entries: any other entry in
    ``models/`` is left to the allowlist, which refuses it."""
    found = (_MODEL_FILE.fullmatch(name) for name in names if name.startswith(_MODELS))
    return sorted(match.group(1) for match in found if match)


def _entries_of(reader, names: set[str], model: str) -> set[str]:
    """The entries program ``model`` may have: its JSON, its sample inputs (never read),
    its payload configs and the raw tensors they name; ``Untrusted`` for a pickled
    payload or a payload name that is not a plain word."""
    entries = {f"{_MODELS}{model}.json", _SAMPLE_INPUTS.format(model)}
    for config_format, folder, prefix in (_WEIGHTS, _CONSTANTS):
        config_name = config_format.format(model)
        if config_name not in names:
            raise Untrusted(f"{config_name!r} is missing (an older or crafted archive)")
        entries.add(config_name)
        config = json.loads(reader.read_bytes(config_name)).get("config", {})
        for fqn, payload in config.items():
            file = payload.get("path_name")
            if not isinstance(file, str) or not _NAME.fullmatch(file):
                raise Untrusted(f"{config_name}: {fqn}'s payload {file!r} is not a plain name")
            if payload.get("use_pickle") or not file.startswith(prefix):
                raise Untrusted(f"{folder}{file} ({fqn}): a pickled object, not raw tensor bytes")
            entries.add(folder + file)
    return entries


def _check_expressions(value) -> None:
    """``Untrusted`` for any shape expression (``expr_str``) in a program's JSON that is
    more than numbers, operators, symbols and shape functions."""
    if isinstance(value, dict):
        for key, each in value.items():
            if key == "expr_str" and not _is_shape_arithmetic(each):
                raise Untrusted(f"the shape expression {str(each)[:60]!r} is not arithmetic")
            _check_expressions(each)
    elif isinstance(value, list):
        for each in value:
            _check_expressions(each)


def _is_shape_arithmetic(text) -> bool:
    if not isinstance(text, str):
        return False
    for match in _QUOTED.finditer(text):
        inner = match.group(1) if match.group(1) is not None else match.group(2)
        if not (_SYMBOL.fullmatch(inner) or _NUMBER.fullmatch(inner)):
            return False
    bare = _QUOTED.sub("0", text)  # no quote is left: the characters allowed hold none
    if not _EXPRESSION_CHARACTERS.fullmatch(bare):
        return False
    known = _SYMPY_NAMES | _shape_functions()
    return all(name in known or _SYMBOL.fullmatch(name) for name in _IDENTIFIER.findall(bare))


@functools.cache
def _shape_functions() -> frozenset[str]:
    """torch's sympy functions (``FloorDiv``, ``CeilToInt``...), which its
    deserializer gives sympify by name."""
    import sympy
    import torch.utils._sympy.functions as shape_functions

    return frozenset(
        name
        for name, value in vars(shape_functions).items()
        if isinstance(value, type) and issubclass(value, sympy.Basic)
    )
