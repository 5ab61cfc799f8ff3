"""A file's attributes, read as data that anyone may have written.

* :func:`plain_attrs`: every attribute whose value is plain data (numbers, text, arrays
  of them), checked against the file's size before it is read; any other (an object or
  region reference, a compound, opaque or enum value, one HDF5 cannot convert) is
  ignored, whatever its type: other tools may add attributes gradstat does not know.
* :func:`integer`, :func:`json_attr`, :func:`number`: a known attribute parsed strictly;
  a value that is not what the format says is a ``DataError`` naming the file and the
  field, never a number made up from it (``world_size`` 2.5 is no learner count).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from gradstat.errors import DataError

#: Kinds of numpy dtypes whose values are plain data: bool, integers, floats, text.
_PLAIN_KINDS = "biufSUO"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _plain(value):
    """An attribute value as a plain Python value (numpy scalars and bytes unwrapped)."""
    if isinstance(value, np.generic):
        value = value.item()
    return _text(value) if isinstance(value, bytes) else value


def _is_plain(attr_id: h5py.h5a.AttrID, file_size: int) -> bool:
    """Whether the attribute holds plain data of a size the file can hold."""
    dtype = attr_id.dtype
    if dtype.kind not in _PLAIN_KINDS or dtype.names is not None:
        return False
    if dtype.kind == "O" and h5py.check_string_dtype(dtype) is None:
        return False  # references and other vlen types
    count = int(np.prod(attr_id.shape, dtype=object)) if attr_id.shape else 1
    return count * max(1, dtype.itemsize) <= max(file_size, 1) * 16


def plain_attrs(obj: h5py.File | h5py.Group, path: Path) -> dict:
    """The plain-data attributes of ``obj`` (see the module docstring), as plain Python
    values; text that is not UTF-8 is a ``DataError`` naming the file."""
    size = Path(path).stat().st_size
    found = {}
    for name in obj.attrs:
        try:
            if not _is_plain(obj.attrs.get_id(name), size):
                continue
            value = obj.attrs[name]
        except (OSError, RuntimeError, TypeError, ValueError, KeyError):
            continue  # a type HDF5 or h5py cannot read: not one of gradstat's
        try:
            found[name] = _plain(value)
        except UnicodeDecodeError:
            raise DataError(f"{path}: attribute {name!r} is not UTF-8 text (damaged)") from None
    return found


def integer(
    attrs: Mapping, key: str, where: str, low: int = 0, high: int = 2**62, default=None
) -> int:
    """``attrs[key]`` as an integer in ``[low, high]`` (an integral float counts); a
    ``DataError`` naming ``where`` and the field otherwise (or when it is missing and
    there is no ``default``)."""
    if key not in attrs:
        if default is None:
            raise DataError(f"{where}: attribute {key} is missing (damaged)")
        return default
    value = attrs[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DataError(
            f"{where}: attribute {key} = {value!r} is not a whole number in {low}..{high} (damaged)"
        )
    return value


def number(attrs: Mapping, key: str, where: str, default: float) -> float:
    """``attrs[key]`` as a float (``default`` when absent); a ``DataError`` otherwise."""
    value = attrs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"{where}: attribute {key} = {value!r} is not a number (damaged)")
    return float(value)


def json_attr(attrs: Mapping, key: str, where: str, default: str | None = None):
    """``attrs[key]``, JSON text, parsed (``default`` parsed when absent; None when that
    is None too); a ``DataError`` naming the field when it is not JSON."""
    text = attrs.get(key, default)
    if text is None:
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise DataError(f"{where}: attribute {key} is not JSON text (damaged)") from None
