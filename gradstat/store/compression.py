"""Lossless HDF5 compression of ``/grad`` rows (``gradstat capture --compression NAME``).

Gradients are noise-like floats: their mantissas do not compress, their sign and exponent
bytes do a little. Byte- or bit-shuffling groups those bytes before the compressor sees
them. ``gzip`` and ``lzf`` are built into every HDF5 (any reader opens the file); ``lz4``
and ``zstd`` are Blosc2 with bit-shuffle through the optional ``hdf5plugin`` package, and
a reader needs ``import hdf5plugin`` before h5py opens the file. docs/format.md has the
measured ratios and writer speeds (benchmarks/storage_compression.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py

from gradstat.errors import DataError, UsageError

INSTALL_HINT = "pip install hdf5plugin (or gradstat[compression])"


def _blosc2(cname: str, clevel: int) -> Callable[[], dict[str, Any]]:
    def filters() -> dict[str, Any]:
        hdf5plugin = _import_hdf5plugin()
        if hdf5plugin is None:
            raise UsageError(f"--compression {cname} needs the hdf5plugin package: {INSTALL_HINT}")
        shuffle = hdf5plugin.Blosc2.BITSHUFFLE
        return dict(hdf5plugin.Blosc2(cname=cname, clevel=clevel, filters=shuffle))

    return filters


#: Name -> keyword arguments of ``h5py.Group.create_dataset`` (built lazily: hdf5plugin
#: is optional).
COMPRESSIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "none": dict,
    "gzip": lambda: {"compression": "gzip", "compression_opts": 1, "shuffle": True},
    "lzf": lambda: {"compression": "lzf", "shuffle": True},
    "lz4": _blosc2("lz4", 5),
    "zstd": _blosc2("zstd", 1),
}


def check_compression(name: str) -> str:
    """``name`` if it is a known compression, else a ``UsageError``."""
    if name not in COMPRESSIONS:
        raise UsageError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {name!r}")
    return name


def dataset_filters(name: str) -> dict[str, Any]:
    """Keyword arguments that make ``create_dataset`` compress with ``name``."""
    return COMPRESSIONS[check_compression(name)]()


def _import_hdf5plugin():
    """hdf5plugin (which registers its filters with HDF5 on import), or None."""
    try:
        return importlib.import_module("hdf5plugin")
    except ImportError:
        return None


def ensure_readable(dataset: h5py.Dataset, path: Path) -> None:
    """Register plugin filters a dataset needs, or name the missing package (DataError)."""
    plist = dataset.id.get_create_plist()
    needed = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    missing = [f for f in needed if not h5py.h5z.filter_avail(f)]
    if missing and _import_hdf5plugin() is not None:
        missing = [f for f in missing if not h5py.h5z.filter_avail(f)]
    if missing:
        raise DataError(
            f"{path}: /grad is compressed with HDF5 filter {missing[0]}, which this "
            f"installation cannot decode: {INSTALL_HINT}"
        )
