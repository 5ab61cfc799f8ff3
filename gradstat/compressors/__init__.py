"""Gradient compressors, error-feedback memories and the communication cost model.

Pure torch math (no I/O): :mod:`~gradstat.compressors.base` defines the protocol every
compressor follows (GRACE's shape, its exchange written once), one module per built-in
implements it, :mod:`~gradstat.compressors.memory` holds the error-feedback memories,
:mod:`~gradstat.compressors.plan` cuts a step into messages as training does,
:mod:`~gradstat.compressors.communicator` (training) and
:mod:`~gradstat.compressors.simulated` (replay) drive the exchanges,
:mod:`~gradstat.compressors.registry` names every built-in and builds a scheme,
:mod:`~gradstat.compressors.spec` parses what users name, and
:mod:`~gradstat.compressors.cost` / :mod:`~gradstat.compressors.work` turn bytes and
work into predicted seconds (this machine's prices are measured:
:mod:`gradstat.analysis.pricing`).
"""

from gradstat.lazy import lazy_attributes

#: Each name's module, imported on first use: the cost model (``--bandwidth`` parsing,
#: ``--help``) needs no torch, the compressors do.
_HOMES = {
    "Compressor": "base",
    "Call": "exchange",
    "Sent": "exchange",
    "SparseRow": "exchange",
    "Transfer": "exchange",
    "TorchCommunicator": "communicator",
    "Link": "cost",
    "collective_seconds": "cost",
    "parse_link": "cost",
    "DGCMemory": "memory",
    "Memory": "memory",
    "NoMemory": "memory",
    "ResidualMemory": "memory",
    "Plan": "plan",
    "build_plan": "plan",
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
