"""Gradient compressors, error-feedback memories, the communication plan and the cost
model: pure torch math, no I/O (each module's job: docs/architecture.md).
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
