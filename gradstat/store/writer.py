"""Writing captures: one SWMR rank file per learner plus the root ``capture.h5``.

Crash safety follows DESIGN.md: each rank file is opened in SWMR mode, every row is
flushed before the ``committed`` attribute is raised, so a reader (or a SIGKILL) sees
either the old or the new committed count, never a half-written row.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np

from gradstat.errors import UsageError
from gradstat.store.compression import dataset_filters
from gradstat.store.dtypes import DTYPE_ATTR, check_dtype, disk_dtype, to_disk_values
from gradstat.store.schema import (
    FORMAT_NAME,
    MAX_CHUNK_BYTES,
    RECORDED_RANKS_ATTR,
    ROOT_FILE,
    SCHEMA_VERSION,
    Layer,
    rank_file_name,
    recorded_ranks,
)


class RankFileWriter:
    """Appends one learner's gradient rows to ``rank-NNNNN.h5`` (SWMR, flushed per row)."""

    def __init__(
        self,
        path: Path,
        rank: int,
        numel: int,
        dtype: str = "float32",
        compression: str = "none",
    ) -> None:
        np_dtype = disk_dtype(dtype)
        filters = dataset_filters(compression)
        if numel <= 0:
            raise UsageError("cannot record an empty gradient (no parameters selected)")
        self.path = Path(path)
        self.numel = numel
        self.dtype = dtype
        self.rows = 0
        self._file = h5py.File(self.path, "w", libver="latest")
        # equal chunks of at most MAX_CHUNK_BYTES: HDF5 stores an edge chunk at full size
        chunks_per_row = -(-numel * np_dtype.itemsize // MAX_CHUNK_BYTES)
        chunk_cols = -(-numel // chunks_per_row)
        self._grad = self._file.create_dataset(
            "grad",
            (0, numel),
            maxshape=(None, numel),
            dtype=np_dtype,
            chunks=(1, chunk_cols),
            **filters,
        )
        self._grad.attrs[DTYPE_ATTR] = dtype
        self._step = self._file.create_dataset(
            "step", (0,), maxshape=(None,), dtype="int64", chunks=(1024,)
        )
        self._loss = self._file.create_dataset(
            "loss", (0,), maxshape=(None,), dtype="float64", chunks=(1024,)
        )
        attrs = self._file.attrs
        attrs["format"] = FORMAT_NAME
        attrs["schema"] = SCHEMA_VERSION
        attrs["rank"] = rank
        attrs["hostname"] = socket.gethostname()
        attrs["writer_pid"] = os.getpid()
        attrs["committed"] = np.int64(0)
        attrs["closed"] = np.int8(0)  # an integer, not an HDF5 enum: every tool reads it
        self._file.swmr_mode = True

    def append(self, step: int, loss: float, row: np.ndarray) -> None:
        """Write one row, flush it, then raise ``committed`` (the commit point).

        ``row`` holds float values (rounded here to the storage type) or, for bfloat16,
        already rounded bit patterns (``uint16``, as the capture hook hands them over).
        """
        n = self.rows + 1
        for dataset in (self._grad, self._step, self._loss):
            dataset.resize(n, axis=0)
        self._grad[n - 1] = to_disk_values(row, self.dtype)
        self._step[n - 1] = step
        self._loss[n - 1] = loss
        for dataset in (self._grad, self._step, self._loss):
            dataset.flush()
        self._file.attrs["committed"] = np.int64(n)
        self._file.flush()
        self.rows = n

    def close(self) -> None:
        if self._file.id.valid:
            self._file.attrs["closed"] = np.int8(1)
            self._file.close()


def write_root(
    run_dir: Path,
    layers: Sequence[Layer],
    world_size: int,
    dtype: str,
    meta: Mapping,
    recorded_ranks: Sequence[int] | None = None,
) -> Path:
    """Create ``capture.h5`` with the metadata and layer table (status ``running``).

    ``world_size`` is the run's number of learners; ``recorded_ranks`` those that write a
    rank file (default: all).
    """
    check_dtype(dtype)
    ranks = list(range(world_size)) if recorded_ranks is None else [int(r) for r in recorded_ranks]
    path = Path(run_dir) / ROOT_FILE
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT_NAME
        f.attrs["schema"] = SCHEMA_VERSION
        f.attrs["world_size"] = world_size
        f.attrs[RECORDED_RANKS_ATTR] = np.array(ranks, dtype=np.int64)
        f.attrs["dtype"] = dtype
        f.attrs["status"] = "running"
        f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for key, value in meta.items():
            f.attrs[key] = value if isinstance(value, (int, float, str)) else json.dumps(value)
        group = f.create_group("layers")
        group.create_dataset(
            "name", data=[layer.name for layer in layers], dtype=h5py.string_dtype()
        )
        group.create_dataset(
            "offset", data=np.array([layer.offset for layer in layers], dtype=np.int64)
        )
        group.create_dataset(
            "numel", data=np.array([layer.numel for layer in layers], dtype=np.int64)
        )
        shapes = group.create_dataset("shape", (len(layers),), dtype=h5py.vlen_dtype(np.int64))
        for i, layer in enumerate(layers):
            shapes[i] = np.array(layer.shape, dtype=np.int64)
    return path


def finalize_root(run_dir: Path, status: str = "complete", virtual: bool = True) -> None:
    """Mark the capture closed and (re)write the virtual datasets over the rank files.

    Virtual datasets are a convenience for other tools (h5ls, HDFView); gradstat itself
    reads the rank files. They cover the rows committed on every rank:
    ``/grad (learners, steps, numel)``, ``/step (learners, steps)``, ``/loss``.
    """
    run_dir = Path(run_dir)
    with h5py.File(run_dir / ROOT_FILE, "r+") as root:
        ranks = recorded_ranks(root.attrs)
        root.attrs["status"] = status
        if not virtual or not all((run_dir / rank_file_name(r)).exists() for r in ranks):
            return  # a failed writer, or multi-node without a shared folder
        sources = []
        for rank in ranks:
            with h5py.File(run_dir / rank_file_name(rank), "r", swmr=True) as f:
                sources.append((int(f.attrs["committed"]), f["grad"].shape[1], f["grad"].dtype))
        rows = min(committed for committed, _, _ in sources)
        numel, dtype = sources[0][1], sources[0][2]
        for name in ("grad", "step", "loss"):
            if name in root:
                del root[name]
        for name, shape, dt in (
            ("grad", (rows, numel), dtype),
            ("step", (rows,), np.int64),
            ("loss", (rows,), np.float64),
        ):
            layout = h5py.VirtualLayout(shape=(len(ranks), *shape), dtype=dt)
            for i, rank in enumerate(ranks):
                layout[i] = h5py.VirtualSource(
                    rank_file_name(rank), name, shape=(rows, *shape[1:])
                )[:rows]
            root.create_virtual_dataset(name, layout)
        root["grad"].attrs[DTYPE_ATTR] = root.attrs["dtype"]
        root.attrs["committed"] = rows


def write_capture(
    run_dir: Path,
    grads: np.ndarray,
    layers: Sequence[Layer],
    steps: Iterable[int] | None = None,
    losses: np.ndarray | None = None,
    dtype: str = "float32",
    meta: Mapping | None = None,
    ranks: Sequence[int] | None = None,
    world_size: int | None = None,
) -> Path:
    """Write a complete capture from an array ``grads[learner, step, numel]``.

    For gradients recorded elsewhere, and for tests that need known data. ``ranks``
    names the learners of ``grads`` (default 0, 1, ...) in a run of ``world_size``
    learners (default: just those).
    """
    grads = np.asarray(grads)
    if grads.ndim != 3:
        raise UsageError("grads must have shape (learners, steps, numel)")
    learners, n_steps, numel = grads.shape
    ranks = list(range(learners)) if ranks is None else [int(r) for r in ranks]
    if len(ranks) != learners:
        raise UsageError(f"{len(ranks)} ranks named for {learners} learners of gradients")
    world = max(ranks) + 1 if world_size is None else world_size
    if layers and layers[-1].stop != numel:
        raise UsageError("the layer table must tile the gradient vector")
    steps = list(range(n_steps)) if steps is None else [int(s) for s in steps]
    losses = np.zeros((learners, n_steps)) if losses is None else np.asarray(losses)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    base_meta = {"workload": "arrays", "backend": "none"}
    write_root(run_dir, layers, world, dtype, {**base_meta, **(meta or {})}, ranks)
    for learner, rank in enumerate(ranks):
        writer = RankFileWriter(run_dir / rank_file_name(rank), rank, numel, dtype)
        for i, step in enumerate(steps):
            writer.append(step, float(losses[learner, i]), grads[learner, i])
        writer.close()
    finalize_root(run_dir)
    return run_dir
