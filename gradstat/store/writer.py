"""Writing captures: one SWMR rank file per learner plus the root ``capture.h5``.

``capture.h5`` is written first, small and whole (gradstat/atomic.py), and replaced only
whole, so no full disk leaves a capture without its layer table.

Crash safety follows docs/format.md: each rank file is opened in SWMR mode, every row is
flushed before the ``committed`` attribute is raised, so a reader (or a SIGKILL) sees
either the old or the new committed count, never a half-written row. Each row goes with
its checksums (schema 3, gradstat/store/checksums.py): one CRC-32C per chunk of /grad
(and /sent) in ``/grad_crc32c`` (``/sent_crc32c``) and one of its step, loss and sent
bytes in ``/record_crc32c``; ``capture.h5`` carries a checksum of the capture's identity
(its ``run_id``, which every rank file repeats) and layer table.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np

from gradstat.atomic import replacing
from gradstat.errors import UsageError
from gradstat.store.checksums import block_checksums, identity_checksum, record_checksum
from gradstat.store.compression import dataset_filters
from gradstat.store.dtypes import DTYPE_ATTR, check_dtype, disk_dtype, to_disk_values
from gradstat.store.schema import (
    BLOCK_ATTR,
    CHECKSUM_ATTR,
    FORMAT_NAME,
    GRAD_CRC,
    MAX_CHUNK_BYTES,
    RECORD_CRC,
    RECORDED_RANKS_ATTR,
    ROOT_FILE,
    RUN_ID_ATTR,
    SCHEMA_VERSION,
    SENT_CRC,
    Layer,
    new_run_id,
    rank_file_name,
    recorded_ranks,
)

#: HDF5 sets aside file space for metadata (the chunk index, object headers) in blocks
#: of this size instead of 2 KiB at a time, so that its small allocations do not fall
#: between the chunks of a row: each row then lies in one run of the file. About 0.02%
#: larger files.
META_BLOCK_BYTES = 1 << 16


class RankFileWriter:
    """Appends one learner's gradient rows to ``rank-NNNNN.h5`` (SWMR, flushed per row).

    A context manager, like ``h5py.File``: ``with RankFileWriter(...) as w: w.append(...)``
    closes the file (marking it ``closed``) however the block ends.

    With ``sent`` it also keeps, per row, what a compression hook made the learner
    contribute (``sent``, same shape and storage as ``grad``) and the payload bytes it put
    into the collectives (``sent_bytes``; docs/format.md, docs/online.md). ``run_id``: the
    capture's identity, as in its ``capture.h5`` (:func:`write_root`); default: read from
    the ``capture.h5`` beside the file, which must then exist.
    """

    def __init__(
        self,
        path: Path,
        rank: int,
        numel: int,
        dtype: str = "float32",
        compression: str = "none",
        sent: bool = False,
        run_id: str | None = None,
    ) -> None:
        np_dtype = disk_dtype(dtype)
        filters = dataset_filters(compression)
        if numel <= 0:
            raise UsageError("cannot record an empty gradient (no parameters selected)")
        self.path = Path(path)
        self.numel = numel
        self.dtype = dtype
        self.rows = 0
        self._file = h5py.File(self.path, "w", libver="latest", meta_block_size=META_BLOCK_BYTES)
        # equal chunks of at most MAX_CHUNK_BYTES: HDF5 stores an edge chunk at full size
        chunks_per_row = -(-numel * np_dtype.itemsize // MAX_CHUNK_BYTES)
        chunk_cols = -(-numel // chunks_per_row)
        self._grad = self._row_dataset("grad", np_dtype, chunk_cols, filters)
        self._step = self._series("step", "int64")
        self._loss = self._series("loss", "float64")
        self._columns = chunk_cols
        self._grad_crc = self._block_checksums(GRAD_CRC, chunks_per_row)
        self._record_crc = self._series(RECORD_CRC, "uint32")
        self._datasets = (self._grad, self._step, self._loss, self._grad_crc, self._record_crc)
        self._sent = self._sent_bytes = self._sent_crc = None
        if sent:
            self._sent = self._row_dataset("sent", np_dtype, chunk_cols, filters)
            self._sent_bytes = self._series("sent_bytes", "float64")
            self._sent_crc = self._block_checksums(SENT_CRC, chunks_per_row)
            self._datasets += (self._sent, self._sent_bytes, self._sent_crc)
        attrs = self._file.attrs
        attrs["format"] = FORMAT_NAME
        attrs["schema"] = SCHEMA_VERSION
        attrs["rank"] = rank
        attrs[RUN_ID_ATTR] = _root_run_id(self.path.parent) if run_id is None else run_id
        attrs["hostname"] = socket.gethostname()
        attrs["writer_pid"] = os.getpid()
        attrs["committed"] = np.int64(0)
        attrs["closed"] = np.int8(0)  # an integer, not an HDF5 enum: every tool reads it
        self._file.swmr_mode = True

    def _row_dataset(
        self, name: str, np_dtype: np.dtype, chunk_cols: int, filters: dict
    ) -> h5py.Dataset:
        """A ``(rows, numel)`` dataset of ``np_dtype`` growing by rows, in chunks of one
        row's ``chunk_cols`` columns, its gradstat dtype name in ``DTYPE_ATTR``."""
        dataset = self._file.create_dataset(
            name,
            (0, self.numel),
            maxshape=(None, self.numel),
            dtype=np_dtype,
            chunks=(1, chunk_cols),
            **filters,
        )
        dataset.attrs[DTYPE_ATTR] = self.dtype
        return dataset

    def _series(self, name: str, dtype: str) -> h5py.Dataset:
        """A 1-D dataset with one value per row, growing by rows."""
        return self._file.create_dataset(name, (0,), maxshape=(None,), dtype=dtype, chunks=(1024,))

    def _block_checksums(self, name: str, blocks: int) -> h5py.Dataset:
        """A ``(rows, blocks)`` uint32 dataset of per-chunk CRC-32Cs, growing by rows."""
        dataset = self._file.create_dataset(
            name,
            (0, blocks),
            maxshape=(None, blocks),
            dtype="uint32",
            chunks=(max(1, min(1024, 16384 // blocks)), blocks),
        )
        dataset.attrs[BLOCK_ATTR] = np.int64(self._columns)
        return dataset

    def append(
        self,
        step: int,
        loss: float,
        row: np.ndarray,
        sent: np.ndarray | None = None,
        sent_bytes: float = float("nan"),
    ) -> None:
        """Write one row, flush it, then raise ``committed`` (the commit point).

        ``row`` (and ``sent``) hold float values (rounded here to the storage type) or,
        for bfloat16, already rounded bit patterns (``uint16``, as the capture hook hands
        them over).
        """
        if (sent is None) != (self._sent is None):
            raise UsageError("give a sent row exactly when the file records sent rows")
        n = self.rows + 1
        with np.errstate(over="ignore"):  # float16 overflows to inf, as HDF5 would cast
            stored = np.asarray(to_disk_values(row, self.dtype), dtype=self._grad.dtype)
        for dataset in self._datasets:
            dataset.resize(n, axis=0)
        self._grad[n - 1] = stored
        self._step[n - 1] = step
        self._loss[n - 1] = loss
        self._grad_crc[n - 1] = block_checksums(stored, self._columns)
        recorded_bytes = None
        if self._sent is not None and self._sent_bytes is not None and self._sent_crc is not None:
            with np.errstate(over="ignore"):
                sent_stored = np.asarray(to_disk_values(sent, self.dtype), dtype=self._grad.dtype)
            self._sent[n - 1] = sent_stored
            self._sent_bytes[n - 1] = sent_bytes
            self._sent_crc[n - 1] = block_checksums(sent_stored, self._columns)
            recorded_bytes = float(sent_bytes)
        self._record_crc[n - 1] = record_checksum(int(step), float(loss), recorded_bytes)
        for dataset in self._datasets:
            dataset.flush()
        self._file.attrs["committed"] = np.int64(n)
        self._file.flush()
        self.rows = n

    def mark_stopped(self, reason: str) -> None:
        """Record why no more rows follow (e.g. ``disk full at step 12``): ``stopped``."""
        self._file.attrs["stopped"] = reason
        self._file.flush()

    def close(self) -> None:
        if self._file.id.valid:
            self._file.attrs["closed"] = np.int8(1)
            self._file.close()

    def __enter__(self) -> RankFileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _root_run_id(run_dir: Path) -> str:
    """The run id in ``run_dir``'s capture.h5, or "" where there is none."""
    try:
        with h5py.File(run_dir / ROOT_FILE, "r") as root:
            value = root.attrs.get(RUN_ID_ATTR, "")
    except OSError:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def write_root(
    run_dir: Path,
    layers: Sequence[Layer],
    world_size: int,
    dtype: str,
    meta: Mapping,
    recorded_ranks: Sequence[int] | None = None,
    run_id: str | None = None,
) -> Path:
    """Create ``capture.h5`` with the metadata and layer table (status ``running``).

    ``world_size`` is the run's number of learners; ``recorded_ranks`` those that write a
    rank file (default: all); ``run_id`` the capture's identity that its rank files
    repeat (default: a new one, :func:`~gradstat.store.schema.new_run_id`).
    """
    check_dtype(dtype)
    ranks = list(range(world_size)) if recorded_ranks is None else [int(r) for r in recorded_ranks]
    run_id = new_run_id() if run_id is None else run_id
    path = Path(run_dir) / ROOT_FILE
    with replacing(path) as handle, h5py.File(handle, "w") as f:
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
        f.attrs[RUN_ID_ATTR] = run_id
        table = [(layer.name, layer.offset, layer.numel, layer.shape) for layer in layers]
        f.attrs[CHECKSUM_ATTR] = np.int64(
            identity_checksum(run_id, world_size, ranks, dtype, table)
        )
    return path


def finalize_root(run_dir: Path, status: str = "complete", virtual: bool = True) -> None:
    """Mark the capture closed and (re)write the virtual datasets over the rank files.

    Virtual datasets are a convenience for other tools (h5ls, HDFView); gradstat itself
    reads the rank files. They cover the rows committed on every rank:
    ``/grad (learners, steps, numel)``, ``/step (learners, steps)``, ``/loss``. The new
    root replaces the old one whole or not at all (gradstat/atomic.py): a disk that is
    full now leaves the root as it was, every committed row readable.
    """
    run_dir = Path(run_dir)
    with replacing(run_dir / ROOT_FILE) as handle:
        with open(run_dir / ROOT_FILE, "rb") as old:
            shutil.copyfileobj(old, handle)
        with h5py.File(handle, "r+") as root:
            _finalize(root, run_dir, status, virtual)


def _finalize(root: h5py.File, run_dir: Path, status: str, virtual: bool) -> None:
    """:func:`finalize_root` on the root file open for writing (a copy, until it is
    written whole)."""
    ranks = recorded_ranks(root.attrs)
    root.attrs["status"] = status
    if not virtual or not all((run_dir / rank_file_name(r)).exists() for r in ranks):
        return  # a failed writer, or multi-node without a shared folder
    sources = []
    with_sent = []
    for rank in ranks:
        with h5py.File(run_dir / rank_file_name(rank), "r", swmr=True) as f:
            sources.append((int(f.attrs["committed"]), f["grad"].shape[1], f["grad"].dtype))
            with_sent.append("sent" in f)
    rows = min(committed for committed, _, _ in sources)
    numel, dtype = sources[0][1], sources[0][2]
    datasets = [
        ("grad", (rows, numel), dtype),
        ("step", (rows,), np.int64),
        ("loss", (rows,), np.float64),
    ]
    if all(with_sent):
        datasets += [("sent", (rows, numel), dtype), ("sent_bytes", (rows,), np.float64)]
    for name in ("grad", "step", "loss", "sent", "sent_bytes"):
        if name in root:
            del root[name]
    for name, shape, dt in datasets:
        layout = h5py.VirtualLayout(shape=(len(ranks), *shape), dtype=dt)
        for i, rank in enumerate(ranks):
            layout[i] = h5py.VirtualSource(rank_file_name(rank), name, shape=(rows, *shape[1:]))[
                :rows
            ]
        root.create_virtual_dataset(name, layout)
    root["grad"].attrs[DTYPE_ATTR] = root.attrs["dtype"]
    if "sent" in root:
        root["sent"].attrs[DTYPE_ATTR] = root.attrs["dtype"]
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
    run_id = new_run_id()
    write_root(run_dir, layers, world, dtype, {**base_meta, **(meta or {})}, ranks, run_id)
    for learner, rank in enumerate(ranks):
        path = run_dir / rank_file_name(rank)
        with RankFileWriter(path, rank, numel, dtype, run_id=run_id) as writer:
            for i, step in enumerate(steps):
                writer.append(step, float(losses[learner, i]), grads[learner, i])
    finalize_root(run_dir)
    return run_dir
