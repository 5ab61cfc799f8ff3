"""Byte sizes: one parser for every size option and one formatter for every size shown.

Convention (everywhere in gradstat): ``kB MB GB TB PB`` are powers of 1000 (``MB`` =
10^6 bytes), ``KiB MiB GiB TiB PiB`` powers of 1024 (``MiB`` = 2^20 bytes); a bare
prefix (``500M``) is refused as ambiguous, a plain number is bytes. Sizes are printed
in the decimal units (``219.5 MB``).
"""

from __future__ import annotations

import re

from gradstat.errors import UsageError

_PREFIXES = "kmgtp"
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?)b|(b))?\s*", re.IGNORECASE)
_DECIMAL = ("B", "kB", "MB", "GB", "TB", "PB")


def parse_bytes(text: str | int, option: str = "size") -> int:
    """Bytes from ``1000``, ``2GB``, ``1.5TB``, ``512MiB`` or ``20 GiB`` (module
    docstring); a ``UsageError`` naming ``option`` for anything else, ``500M`` included."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.fullmatch(str(text))
        if match is None:
            raise UsageError(f"{option} {text!r}: {_hint(str(text))}")
        number, prefix, binary, _ = match.groups()
        power = _PREFIXES.index(prefix.lower()) + 1 if prefix else 0
        value = int(float(number) * (1024 if binary else 1000) ** power)
    if value <= 0:
        raise UsageError(f"{option} {text!r}: must be positive")
    return value


def _hint(text: str) -> str:
    bare = re.fullmatch(r"\s*([\d.]+)\s*([kmgtp])\s*", text, re.IGNORECASE)
    if bare is None:
        return "expected a size such as 2GB, 512MiB or 1000000"
    number, prefix = bare.groups()
    decimal = "k" if prefix in "kK" else prefix.upper()
    return f"say {number}{decimal}B (decimal) or {number}{prefix.upper()}iB (powers of 1024)"


def format_bytes(nbytes: float) -> str:
    """Decimal units, 4 significant digits: ``512 B``, ``219.5 MB``, ``1.5 GB``."""
    value = float(nbytes)
    for unit in _DECIMAL[:-1]:
        if abs(value) < 1000:
            return f"{int(value)} B" if unit == "B" else f"{value:.4g} {unit}"
        value /= 1000
    return f"{value:.4g} {_DECIMAL[-1]}"
