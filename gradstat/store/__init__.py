"""The HDF5 capture format: write per rank, open, validate and read lazily."""

from gradstat.store.reader import Capture, open_capture
from gradstat.store.schema import Layer, layer_table
from gradstat.store.scope import Scope, resolve_scopes
from gradstat.store.writer import RankFileWriter, finalize_root, write_capture, write_root

__all__ = [
    "Capture",
    "Layer",
    "RankFileWriter",
    "Scope",
    "finalize_root",
    "layer_table",
    "open_capture",
    "resolve_scopes",
    "write_capture",
    "write_root",
]
