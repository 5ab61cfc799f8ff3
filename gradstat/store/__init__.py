"""The HDF5 capture format: write per rank, open, validate and read lazily."""

from gradstat.lazy import lazy_attributes

#: Each name's module, imported on first use (``gradstat --help`` needs none of h5py).
_HOMES = {
    "Capture": "gradstat.store.reader",
    "open_capture": "gradstat.store.reader",
    "Layer": "gradstat.store.schema",
    "layer_table": "gradstat.store.schema",
    "Scope": "gradstat.store.scope",
    "resolve_scopes": "gradstat.store.scope",
    "RankFileWriter": "gradstat.store.writer",
    "finalize_root": "gradstat.store.writer",
    "write_capture": "gradstat.store.writer",
    "write_root": "gradstat.store.writer",
}


__getattr__ = lazy_attributes("gradstat.store", _HOMES, globals())


__all__ = sorted(_HOMES)
