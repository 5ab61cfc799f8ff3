"""Gradient compressors, error-feedback memories and the communication cost model.

Pure torch math (no I/O): :mod:`~gradstat.compressors.legacy` defines the interface,
:mod:`~gradstat.compressors.registry` names every compressor, and
:mod:`~gradstat.compressors.cost` turns bytes into predicted seconds.
"""

from gradstat.compressors.cost import Link, collective_seconds, parse_link
from gradstat.compressors.legacy import Compressor, Exchange, LocalCompressor, Payload, Transfer
from gradstat.compressors.memory import DGCMemory, NoMemory, ResidualMemory
from gradstat.compressors.registry import (
    REGISTRY,
    CompressorSpec,
    Scheme,
    build_scheme,
    parse_compressors,
)

__all__ = [
    "REGISTRY",
    "Compressor",
    "CompressorSpec",
    "DGCMemory",
    "Exchange",
    "Link",
    "LocalCompressor",
    "NoMemory",
    "Payload",
    "ResidualMemory",
    "Scheme",
    "Transfer",
    "build_scheme",
    "collective_seconds",
    "parse_compressors",
    "parse_link",
]
