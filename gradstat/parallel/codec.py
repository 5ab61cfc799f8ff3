"""Everything between processes and ranks travels as JSON text, never as pickles.

Units return lists of plain records (dicts of numbers, strings, booleans, ``None``,
lists and dicts); NaN and infinities use Python's JSON extensions (``NaN``,
``Infinity``), and floats round-trip exactly (shortest repr). numpy scalars become Python
numbers on the way, so every execution mode (loop, ``--jobs``, torchrun) goes through the
same encoding and yields identical records.

A unit's context (the :class:`~gradstat.analysis.selection.Selection`, an analysis's
parameters, the :class:`~gradstat.analysis.compute.Compute`) is made of frozen
dataclasses and tuples; :func:`to_typed` writes them as ``{"__dataclass__":
"gradstat.module:Class", "fields": {...}}`` and ``{"__tuple__": [...]}``, and
:func:`from_typed` builds them again through their constructors (so their validation
runs again). Only dataclasses defined in gradstat's own modules are built: a message
cannot make a process import or call anything else.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
from typing import Any

import numpy as np

_DATACLASS, _TUPLE, _ENUM = "__dataclass__", "__tuple__", "__enum__"


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON-able")


def encode(document: Any) -> bytes:
    """``document`` as compact UTF-8 JSON (NaN kept)."""
    return json.dumps(document, default=_plain, separators=(",", ":")).encode()


def decode(data: bytes | str) -> Any:
    """The document :func:`encode` wrote."""
    return json.loads(data)


def roundtrip(document: Any) -> Any:
    """What ``document`` becomes after travelling between processes."""
    return decode(encode(document))


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _gradstat_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if module != "gradstat" and not module.startswith("gradstat."):
        raise ValueError(f"refusing to build {name!r}: not a gradstat class")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not isinstance(found, type):
        raise ValueError(f"{name!r} is not a class")
    return found


def to_typed(value: Any) -> Any:
    """``value`` with dataclasses, enums and tuples spelled out for :func:`from_typed`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: to_typed(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
        return {_DATACLASS: _class_name(type(value)), "fields": fields}
    if isinstance(value, enum.Enum):
        return {_ENUM: _class_name(type(value)), "value": to_typed(value.value)}
    if isinstance(value, tuple):
        return {_TUPLE: [to_typed(v) for v in value]}
    if isinstance(value, list):
        return [to_typed(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("only dicts with string keys travel between processes")
        return {k: to_typed(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a {type(value).__name__} cannot travel between processes")


def from_typed(value: Any) -> Any:
    """The value :func:`to_typed` spelled out."""
    if isinstance(value, list):
        return [from_typed(v) for v in value]
    if not isinstance(value, dict):
        return value
    if _TUPLE in value:
        return tuple(from_typed(v) for v in value[_TUPLE])
    if _DATACLASS in value:
        cls = _gradstat_class(value[_DATACLASS])
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"{value[_DATACLASS]!r} is not a dataclass")
        return cls(**{k: from_typed(v) for k, v in value["fields"].items()})
    if _ENUM in value:
        cls = _gradstat_class(value[_ENUM])
        if not issubclass(cls, enum.Enum):
            raise ValueError(f"{value[_ENUM]!r} is not an enum")
        return cls(from_typed(value["value"]))
    return {k: from_typed(v) for k, v in value.items()}
