"""Gradient compressors, error-feedback memories and the communication cost model.

Pure torch math (no I/O): :mod:`~gradstat.compressors.base` defines the protocol every
compressor follows (GRACE's shape), one module per built-in implements it,
:mod:`~gradstat.compressors.memory` holds the error-feedback memories,
:mod:`~gradstat.compressors.communicator` the collectives, :mod:`~gradstat.compressors.
registry` names every built-in, and :mod:`~gradstat.compressors.cost` /
:mod:`~gradstat.compressors.work` turn bytes and work into predicted seconds.
"""

from gradstat.lazy import lazy_attributes

#: Each name's module, imported on first use: the cost model (``--bandwidth`` parsing,
#: ``--help``) needs no torch, the compressors do.
_HOMES = {
    "Compressor": "base",
    "OnlineStep": "exchange",
    "StepOutcome": "exchange",
    "Stream": "exchange",
    "Transfer": "exchange",
    "Communicator": "communicator",
    "TorchCommunicator": "communicator",
    "Link": "cost",
    "collective_seconds": "cost",
    "parse_link": "cost",
    "DGCMemory": "memory",
    "Memory": "memory",
    "NoMemory": "memory",
    "ResidualMemory": "memory",
    "REGISTRY": "registry",
    "CompressorSpec": "registry",
    "Context": "registry",
    "Entry": "registry",
    "Scheme": "registry",
    "build_scheme": "registry",
    "parse_compressors": "spec",
}


__getattr__ = lazy_attributes(
    "gradstat.compressors",
    {name: f"gradstat.compressors.{home}" for name, home in _HOMES.items()},
    globals(),
)


__all__ = sorted(_HOMES)
