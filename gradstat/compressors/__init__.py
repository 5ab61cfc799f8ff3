"""Gradient compressors, error-feedback memories and the communication cost model.

Pure torch math (no I/O): :mod:`~gradstat.compressors.legacy` defines the interface,
:mod:`~gradstat.compressors.registry` names every compressor, and
:mod:`~gradstat.compressors.cost` turns bytes into predicted seconds.
"""

from importlib import import_module

#: Each name's module, imported on first use: the cost model (``--bandwidth`` parsing,
#: ``--help``) needs no torch, the compressors do.
_HOMES = {
    "Compressor": "legacy",
    "Exchange": "legacy",
    "LocalCompressor": "legacy",
    "Payload": "legacy",
    "Transfer": "legacy",
    "Link": "cost",
    "collective_seconds": "cost",
    "parse_link": "cost",
    "DGCMemory": "memory",
    "NoMemory": "memory",
    "ResidualMemory": "memory",
    "REGISTRY": "registry",
    "CompressorSpec": "registry",
    "Scheme": "registry",
    "build_scheme": "registry",
    "parse_compressors": "registry",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gradstat.compressors' has no attribute {name!r}")
    value = getattr(import_module(f"gradstat.compressors.{home}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_HOMES)
