"""The model's own output types (a dataclass, a NamedTuple, a Hugging Face ``ModelOutput``):
recorded, flattened to plain containers for what runs, and rebuilt for the user.

Traces, exports and compiled packages return plain tuples, lists and dicts, and a saved
file holds no Python class. ``optimize`` therefore runs the model as ``PlainOutputs``
(a dataclass becomes the dict of its fields, a NamedTuple a tuple), records the types it
returned with ``record`` (JSON: each container's kind, its keys or fields, and a type's
``module:qualname``; kept in ``Spec.output_types``), and ``Rebuild`` puts them back on
what any runner or loaded artifact returns.

Loading never unpickles nor imports what the file asks for at will: a recorded type is
used when this process recorded it itself, when its module is already imported (the
user's code that defines it), or when it is a module of one of the packages known to
define output types (``IMPORTABLE``: ``transformers``, torchvision, bladesmith), which
is then imported; and only a class of the recorded kind (a dataclass, a NamedTuple)
with the recorded fields is called.
Anything else comes back plain, with one warning naming the type. A dict subclass that
is not a dataclass comes back as a plain dict.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import warnings
import weakref

from torch import nn

# The packages whose modules a file may name for its output types, imported when not yet:
# they define the output types of the models bladesmith takes. Any other module must be
# imported by the user first (an artifact could otherwise import any installed module).
IMPORTABLE = frozenset({"transformers", "torchvision", "bladesmith"})

# The types this process recorded: the model's own, trusted as it is (even a class
# defined in a function, which no name finds).
_RECORDED: weakref.WeakValueDictionary[str, type] = weakref.WeakValueDictionary()


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _is_dataclass(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def plain(value):
    """``value`` with its dataclasses as dicts of their fields (a ``ModelOutput``: of the
    entries it holds), NamedTuples as tuples and other dict, list and tuple subclasses as
    dicts, lists and tuples, at any depth."""
    if isinstance(value, dict) or _is_dataclass(value):
        return {key: plain(each) for key, each in _entries(value).items()}
    if isinstance(value, (list, tuple)):
        items = [plain(each) for each in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _entries(value) -> dict:
    """A dict's items; a dataclass's fields by name (a ``ModelOutput``, a dict: only the
    entries it holds)."""
    if isinstance(value, dict):
        return dict(value)
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def record(value) -> dict | None:
    """The structure of ``value`` as JSON, the types in it named; None when it holds no
    dataclass or NamedTuple (nothing to rebuild) or a key JSON cannot hold."""
    tree = _node(value)
    return tree if tree is not None and _holds_type(tree) else None


def _node(value) -> dict | None:
    if _is_dataclass(value):
        entries = _entries(value)
        return _typed("dataclass", type(value), list(entries), list(entries.values()))
    if _is_namedtuple(value):
        return _typed("namedtuple", type(value), list(type(value)._fields), list(value))
    if isinstance(value, dict):
        if not all(isinstance(key, (str, int)) for key in value):
            return None
        return {"kind": "dict", "keys": list(value), "items": [_node(v) for v in value.values()]}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {"kind": kind, "items": [_node(each) for each in value]}
    return None  # a leaf: a tensor, a number, None


def _typed(kind: str, cls: type, keys: list, items: list) -> dict:
    name = f"{cls.__module__}:{cls.__qualname__}"
    _RECORDED[name] = cls
    return {"kind": kind, "type": name, "keys": keys, "items": [_node(each) for each in items]}


def _holds_type(tree: dict | None) -> bool:
    return tree is not None and ("type" in tree or any(map(_holds_type, tree["items"])))


class PlainOutputs(nn.Module):
    """``model`` returning ``plain`` outputs: what traces, exports and compilers take."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return plain(self.model(*args, **kwargs))


class Rebuild:
    """Puts the types of a ``record`` back on a plain structure. The types are found once,
    here; one that cannot be (``find``) is left plain, with a warning naming it."""

    def __init__(self, tree: dict):
        self.tree = tree
        self.types = {name: find(name, kind) for name, kind in _type_names(tree).items()}
        missing = sorted(name for name, cls in self.types.items() if cls is None)
        if missing:
            warnings.warn(
                f"output type {', '.join(missing)} not found (its module is not imported, and "
                f"only modules of {', '.join(sorted(IMPORTABLE))} are imported for a file): "
                "outputs are returned as plain dicts and tuples; import the module that "
                "defines it before loading to get it back",
                stacklevel=3,
            )

    def __call__(self, value):
        return self._rebuilt(value, self.tree)

    def _rebuilt(self, value, tree: dict | None):
        if tree is None:
            return value
        keys, trees = tree.get("keys"), tree["items"]
        if isinstance(value, dict) and keys is not None:
            items = [value.get(key) for key in keys]
        elif isinstance(value, (list, tuple)) and len(value) == len(trees):
            items = list(value)
        else:
            return value  # not the recorded structure: as it came
        items = [self._rebuilt(item, each) for item, each in zip(items, trees)]
        cls = self.types.get(tree.get("type"))
        if cls is not None and tree["kind"] == "namedtuple" and len(cls._fields) == len(items):
            return cls(*items)
        if cls is not None and set(keys) <= {f.name for f in dataclasses.fields(cls)}:
            # A ModelOutput is given the entries it held, and holds only those.
            return _dataclass(cls, dict(zip(keys, items)))
        if tree["kind"] in ("dict", "dataclass"):  # what plain() makes of them
            return dict(zip(keys, items))
        return items if tree["kind"] == "list" else tuple(items)


def _dataclass(cls: type, values: dict):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    made = cls(**{k: v for k, v in values.items() if fields[k].init})
    for key, value in values.items():
        if not fields[key].init:
            object.__setattr__(made, key, value)
    return made


def _type_names(tree: dict | None) -> dict[str, str]:
    """{type name: its kind} of every type in ``tree``."""
    if tree is None:
        return {}
    names = {tree["type"]: tree["kind"]} if "type" in tree else {}
    for each in tree["items"]:
        names.update(_type_names(each))
    return names


def find(name: str, kind: str) -> type | None:
    """The class ``name`` (``module:qualname``) names, a ``kind`` ("dataclass" or
    "namedtuple"), found without running code the artifact brings (see the module's
    docstring), or None."""
    if name in _RECORDED:
        return _RECORDED[name]
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None and module_name.partition(".")[0] in IMPORTABLE:
        try:
            module = importlib.import_module(module_name)
        except Exception:
            return None
    found = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if _is_output_class(found, kind) else None


def _is_output_class(found, kind: str) -> bool:
    """Only a dataclass or a NamedTuple class, as recorded, is ever called to rebuild an
    output."""
    if not isinstance(found, type):
        return False
    if kind == "namedtuple":
        return issubclass(found, tuple) and isinstance(getattr(found, "_fields", None), tuple)
    return kind == "dataclass" and dataclasses.is_dataclass(found)
