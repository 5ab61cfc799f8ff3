"""Package attributes imported on first use (PEP 562 module ``__getattr__``).

Keeps ``import gradstat`` and ``gradstat --help`` free of torch, h5py and numba: a
package lists each public name's home module, and the name is imported when first read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(
    package: str, homes: Mapping[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes[name]`` is the module that
    defines ``name``; the value is imported once and cached in ``namespace`` (the
    package's ``globals()``). Other names raise ``AttributeError`` as Python would."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(home), name)
        namespace[name] = value
        return value

    return __getattr__
