"""A capture's metadata, read and validated: everything but the gradient rows.

:func:`read_index` opens ``capture.h5`` and every rank file, reads their attributes,
layer table, steps, losses and sent bytes, and checks them (docs/format.md,
"Integrity"), so that a damaged or mismatched file is an error naming it, never data:

* the root: format and schema, ``world_size`` (a whole number in range, and without
  ``recorded_ranks`` as many rank files in the folder, counted before any list of
  ranks is made), ``recorded_ranks`` (sorted, distinct, inside the run), the storage
  type, a layer table whose columns are sized by the file and that tiles the flat
  vector exactly (shapes of dimensions >= 1, their products in exact integers), and,
  where it carries one, the CRC-32C of the identity and layer table (``checksum``);
* each rank file: that it is the rank its name says (``rank``) of this capture
  (``run_id``), rows of the layer table's length in the capture's type, ``committed``
  within what every dataset holds and what the file can store, the checksum datasets
  of the schema its checksums show (whatever its ``schema`` attribute says), each
  row's step, loss and sent bytes against their CRC-32C (schema 3), steps strictly
  increasing, and the file's structure (gradstat/store/verify.py).

Attributes are read as data (gradstat/store/attrs.py): known ones strictly, unknown
ones ignored whatever their HDF5 type.

It runs in a forked child with a time limit (gradstat/store/guard.py): damaged HDF5
metadata can make HDF5 loop for minutes. Files closed cleanly are opened in plain read
mode, which fails at once on damaged metadata; only files still flagged "open for
write" (being written, or their writer killed) need SWMR-read mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from gradstat.errors import DataError
from gradstat.store.attrs import integer, plain_attrs
from gradstat.store.checksums import identity_checksum, record_checksum
from gradstat.store.compression import ensure_readable
from gradstat.store.dtypes import DISK_DTYPES
from gradstat.store.guard import reading
from gradstat.store.ranks import format_ranks
from gradstat.store.schema import (
    BLOCK_ATTR,
    CHECKSUM_ATTR,
    FORMAT_NAME,
    GRAD_CRC,
    MAX_LEARNERS,
    MAX_NUMEL,
    READABLE_SCHEMAS,
    RECORD_CRC,
    RECORDED_RANKS_ATTR,
    ROW_CRC,
    RUN_ID_ATTR,
    SENT_CRC,
    Layer,
    rank_file_name,
    recorded_ranks,
)
from gradstat.store.verify import Damage, structural_damage

#: Smallest possible HDF5 file (a version-0 superblock and a root group).
_MIN_HDF5_BYTES = 96
#: Errors of HDF5 and h5py while reading metadata, which name damage, not bugs.
_READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError)


@dataclass
class RankIndex:
    """One rank file's metadata: its committed rows' steps, losses and sent bytes."""

    rank: int
    path: Path
    swmr: bool  # whether it opens only in SWMR-read mode (flagged "open for write")
    committed: int
    steps: np.ndarray
    losses: np.ndarray
    sent_bytes: np.ndarray | None  # only in files with /sent
    closed: bool
    hostname: str
    writer_pid: int
    stopped: str | None
    damage: Damage | None = None
    schema: int = 3  # what it is checked as: its checksums, whatever its attribute says


@dataclass
class CaptureIndex:
    """A capture's metadata: root attributes, layer table and every rank file's index."""

    root_path: Path
    meta: dict
    schema: int
    layers: list[Layer]
    ranks: list[RankIndex] = field(default_factory=list)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reason(exc: BaseException) -> str:
    text = str(exc).split("(")[0].strip() if isinstance(exc, OSError) else str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _open_plain(path: Path) -> h5py.File:
    """``path`` opened in plain read mode; a ``DataError`` for what is not HDF5."""
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    size = path.stat().st_size
    if size < _MIN_HDF5_BYTES or not h5py.is_hdf5(path):
        raise DataError(f"{path}: not an HDF5 file ({size:,} bytes; truncated or damaged?)")
    return h5py.File(path, "r")


def _open_rank(path: Path) -> tuple[h5py.File, bool]:
    """A rank file opened for reading, and whether it needed SWMR-read mode."""
    reading(str(path))
    try:
        return _open_plain(path), False
    except OSError as exc:
        text = str(exc)
        if "already open for write" not in text and "lock" not in text:
            raise DataError(
                f"{path}: cannot be read, truncated or damaged? ({_reason(exc)})"
            ) from None
    try:
        return h5py.File(path, "r", swmr=True), True
    except OSError as exc:
        raise DataError(f"{path}: cannot be read, truncated or damaged? ({_reason(exc)})") from None


def read_index(root_path: Path) -> CaptureIndex:
    """Read and check a capture's metadata (see the module docstring); ``DataError``
    names the first file that is damaged beyond listing its damaged rows."""
    index = _read_root(root_path)
    folder = root_path.parent
    _require_rank_files(folder, recorded_ranks(index.meta))
    for rank in recorded_ranks(index.meta):
        path = folder / rank_file_name(rank)
        try:
            index.ranks.append(_read_rank(path, rank, index))
        except _READ_ERRORS as exc:  # HDF5 and h5py errors: damage
            raise DataError(f"{path} (learner {rank}): cannot be read ({_reason(exc)})") from None
    return index


def _require_rank_files(folder: Path, ranks: list[int]) -> None:
    """A ``DataError`` listing the learners whose rank files are not in ``folder``, with
    the fix for a capture written by several nodes into separate folders."""
    missing = [r for r in ranks if not (folder / rank_file_name(r)).exists()]
    if missing:
        names = ", ".join(rank_file_name(r) for r in missing[:3])
        raise DataError(
            f"{folder}: the rank files of learners {format_ranks(missing)} are missing "
            f"({names}{', ...' if len(missing) > 3 else ''}); if the capture was written "
            f"by several nodes into separate folders, join them: gradstat merge DEST "
            f"{folder} OTHER_NODES_FOLDERS..."
        )


def _read_root(root_path: Path) -> CaptureIndex:
    reading(str(root_path))
    try:
        with _open_plain(root_path) as root:
            meta = plain_attrs(root, root_path)
            if meta.get("format") != FORMAT_NAME or "schema" not in meta:
                raise DataError(f"{root_path}: an HDF5 file, but not a gradstat capture")
            schema = integer(meta, "schema", str(root_path))
            if schema not in READABLE_SCHEMAS:
                raise DataError(
                    f"{root_path}: capture schema {schema} is not supported (this gradstat "
                    f"reads schemas {', '.join(map(str, READABLE_SCHEMAS))})"
                )
            if "layers" not in root:
                raise DataError(f"{root_path}: the layer table is missing")
            layers = _read_layers(root["layers"], root_path)
    except (DataError, UnicodeDecodeError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{root_path}: cannot be read ({_reason(exc)})") from None
    except _READ_ERRORS as exc:
        raise DataError(
            f"{root_path}: cannot be read, truncated or damaged? ({_reason(exc)})"
        ) from None
    index = CaptureIndex(root_path, meta, schema, layers)
    _check_root(index)
    return index


_LAYER_COLUMNS = {"name": "OSU", "offset": "iu", "numel": "iu", "shape": "O"}


def _read_layers(group: h5py.Group, path: Path) -> list[Layer]:
    """The layer table, each column's type and length checked before it is read (a
    column of 10^12 rows in a file of kilobytes is damage, not a model)."""
    size = path.stat().st_size
    columns = {}
    for name, kinds in _LAYER_COLUMNS.items():
        column = group.get(name)
        if not isinstance(column, h5py.Dataset):
            raise DataError(f"{path}: the layer table has no column /layers/{name} (damaged)")
        if column.ndim != 1 or column.dtype.kind not in kinds or column.shape[0] > size:
            what = "text" if name == "name" else "integers"
            raise DataError(
                f"{path}: /layers/{name} is not a column of {what} of at most one row per "
                "byte of the file (damaged)"
            )
        columns[name] = column[()]
    if len({len(c) for c in columns.values()}) != 1:
        raise DataError(f"{path}: the layer table's columns differ in length (damaged)")
    return [
        Layer(_text(name), int(o), int(n), tuple(int(s) for s in np.atleast_1d(shape)))
        for name, o, n, shape in zip(*columns.values(), strict=True)
    ]


def _check_root(index: CaptureIndex) -> None:
    """The root's identity and layer table are consistent (and match their checksum)."""
    path, meta = index.root_path, index.meta
    world = integer(meta, "world_size", str(path), 1, MAX_LEARNERS)
    if RECORDED_RANKS_ATTR not in meta:  # all learners: as many rank files, before listing
        _require_rank_count(path.parent, world)
    try:
        ranks = recorded_ranks(meta)
    except (TypeError, ValueError):
        raise DataError(f"{path}: attribute recorded_ranks is not a list of ranks") from None
    dtype = str(meta.get("dtype"))
    if not ranks or ranks != sorted(set(ranks)) or not 0 <= ranks[0] <= ranks[-1] < world:
        raise DataError(
            f"{path}: recorded_ranks {ranks} are not distinct sorted ranks of a run of "
            f"{world} learners (damaged)"
        )
    if dtype not in DISK_DTYPES:
        raise DataError(f"{path}: unknown storage dtype {dtype!r}")
    _check_layers(path, index.layers)
    if index.schema >= 3 or CHECKSUM_ATTR in meta:  # a checksum is checked, whatever the schema
        if RUN_ID_ATTR not in meta or CHECKSUM_ATTR not in meta:
            raise DataError(f"{path}: schema {index.schema} but no run_id or checksum (damaged)")
        table = [(la.name, la.offset, la.numel, la.shape) for la in index.layers]
        expected = identity_checksum(str(meta[RUN_ID_ATTR]), world, ranks, dtype, table)
        recorded = integer(meta, CHECKSUM_ATTR, str(path), 0, 2**32 - 1)
        if recorded != expected:
            raise DataError(
                f"{path}: the capture's identity or layer table does not match its "
                f"CRC-32C (computed {expected:08x}, recorded {recorded:08x}): damaged"
            )


def _require_rank_count(folder: Path, world: int) -> None:
    """A capture of all ``world`` learners has ``world`` rank files: counted from the
    folder's listing, so that a damaged ``world_size`` lists no ranks that are not there."""
    present = sum(1 for p in folder.glob("rank-*.h5") if p.name[5:-3].isdigit())
    if present < world:
        names = ", ".join(rank_file_name(r) for r in _next_missing(folder, world, 3))
        raise DataError(
            f"{folder}: capture.h5 says world_size {world} (no recorded_ranks), but the "
            f"folder holds {present} rank files: {world - present} are missing ({names}, "
            f"...); if the capture was written by several nodes into separate folders, "
            f"join them: gradstat merge DEST {folder} OTHER_NODES_FOLDERS..."
        )


def _next_missing(folder: Path, world: int, count: int) -> list[int]:
    """The first ``count`` ranks below ``world`` without a rank file in ``folder``."""
    missing = []
    for rank in range(world):
        if not (folder / rank_file_name(rank)).exists():
            missing.append(rank)
            if len(missing) == count:
                break
    return missing


def _check_layers(path: Path, layers: list[Layer]) -> None:
    """Layers tile the flat vector: offsets from 0, each where the last ended, sizes
    that match their shapes (every dimension at least 1, the product in exact integers:
    no shape wraps around), distinct names, and a vector of at most ``MAX_NUMEL``."""
    if not layers:
        raise DataError(f"{path}: the layer table is empty")
    at = 0
    for layer in layers:
        size = 1
        for dim in layer.shape:
            size *= dim
        if (
            layer.offset != at
            or layer.numel < 1
            or size != layer.numel
            or min(layer.shape, default=1) < 1
        ):
            raise DataError(
                f"{path}: the layer table is damaged at {layer.name!r} (offset "
                f"{layer.offset}, numel {layer.numel}, shape {list(layer.shape)}; it must "
                f"start at {at} and hold its shape's {size} values, each dimension >= 1)"
            )
        at = layer.stop
        if at > MAX_NUMEL:
            raise DataError(
                f"{path}: the layer table is damaged at {layer.name!r}: the vector would "
                f"hold {at:,} values, more than {MAX_NUMEL:,}"
            )
    if len({layer.name for layer in layers}) != len(layers):
        raise DataError(f"{path}: the layer table names a layer twice (damaged)")


def _read_rank(path: Path, rank: int, index: CaptureIndex) -> RankIndex:
    f, swmr = _open_rank(path)
    with f:
        attrs = plain_attrs(f, path)
        learner = f"{path} (learner {rank})"
        if attrs.get("format", FORMAT_NAME) != FORMAT_NAME or "grad" not in f:
            raise DataError(f"{learner}: not a gradstat rank file")
        declared = integer(attrs, "schema", learner, default=index.schema)
        if declared != index.schema:
            raise DataError(
                f"{learner}: schema {declared}, but capture.h5 has schema {index.schema}"
            )
        schema = _checked_as(f, declared)
        holds = integer(attrs, "rank", learner, 0, MAX_LEARNERS, default=rank)
        if holds != rank:
            raise DataError(
                f"{learner}: holds the rows of learner {holds} (its rank attribute): rank "
                "files swapped or renamed?"
            )
        identified = schema >= 3 or RUN_ID_ATTR in attrs
        if identified and str(attrs.get(RUN_ID_ATTR)) != str(index.meta.get(RUN_ID_ATTR)):
            raise DataError(
                f"{learner}: belongs to another capture (run id {attrs.get(RUN_ID_ATTR)}, "
                f"capture.h5 has {index.meta.get(RUN_ID_ATTR)})"
            )
        committed = _committed(f, attrs, learner, index, schema)
        steps = np.asarray(f["step"][:committed], dtype=np.int64)
        losses = np.asarray(f["loss"][:committed], dtype=np.float64)
        sent_bytes = (
            np.asarray(f["sent_bytes"][:committed], dtype=np.float64) if "sent" in f else None
        )
        damage = _record_damage(f, path, rank, schema, steps, losses, sent_bytes)
        if damage is None:  # SWMR reads retry damaged metadata for minutes: walk it here
            short = not _rows_stored(f, path, committed)  # rows the file cannot hold
            damage = structural_damage(f, path, rank, committed, walk=swmr or short)
        return RankIndex(
            rank=rank,
            path=path,
            swmr=swmr,
            committed=committed,
            steps=steps,
            losses=losses,
            sent_bytes=sent_bytes,
            closed=bool(integer(attrs, "closed", learner, 0, 1, default=1)),
            hostname=str(attrs.get("hostname", "")),
            writer_pid=integer(attrs, "writer_pid", learner, -1, 2**31, default=-1),
            stopped=str(attrs["stopped"]) if "stopped" in attrs else None,
            damage=damage,
            schema=schema,
        )


def _checked_as(f: h5py.File, declared: int) -> int:
    """The schema a rank file is checked as: that of the checksums it carries (schema 3:
    per-chunk and per-record CRC-32Cs, schema 2: per-row), whatever its ``schema``
    attribute says (a schema-3 file relabelled 1 would be read unchecked)."""
    if GRAD_CRC in f and RECORD_CRC in f:
        return max(declared, 3)
    if ROW_CRC in f:
        return max(declared, 2)
    return declared


def _rows_stored(f: h5py.File, path: Path, committed: int) -> bool:
    """Whether /grad (and /sent) can hold ``committed`` rows: uncompressed, their bytes
    fit in the file (one ``stat``); compressed, as many chunks are stored as the rows
    need. A row of 10^12 values in a file of megabytes has chunks never written."""
    size = path.stat().st_size
    for name in ("grad", "sent"):
        if name not in f or committed == 0:
            continue
        dataset = f[name]
        if dataset.id.get_create_plist().get_nfilters() == 0:
            if committed * dataset.shape[1] * dataset.dtype.itemsize > size:
                return False
        elif dataset.chunks is not None:
            per_row = -(-dataset.shape[1] // dataset.chunks[1])
            if dataset.id.get_num_chunks() < -(-committed // dataset.chunks[0]) * per_row:
                return False
    return True


def _committed(f: h5py.File, attrs: dict, learner: str, index: CaptureIndex, schema: int) -> int:
    """The ``committed`` attribute, checked against what the datasets hold."""
    grad = f["grad"]
    numel = index.layers[-1].stop
    dtype = DISK_DTYPES[str(index.meta["dtype"])]
    if grad.ndim != 2 or grad.dtype.newbyteorder("=") != dtype.newbyteorder("="):
        raise DataError(
            f"{learner}: /grad holds {grad.dtype}, capture.h5 says {index.meta['dtype']}"
        )
    if grad.shape[1] != numel:
        raise DataError(f"{learner}: rows of {grad.shape[1]} values, layer table has {numel}")
    ensure_readable(grad, Path(f.filename))
    if "committed" not in attrs:
        raise DataError(f"{learner}: no committed attribute (not a gradstat rank file?)")
    committed = attrs["committed"]
    if isinstance(committed, bool) or not isinstance(committed, int) or committed < 0:
        raise DataError(f"{learner}: committed = {committed!r} is not a row count (damaged)")
    required = ["step", "loss", *_checksum_names(f, schema, learner)]
    if "sent" in f:
        required += ["sent", "sent_bytes"]
    for name in ["grad", *required]:
        if name not in f:
            raise DataError(f"{learner}: /{name} is missing (damaged)")
        if f[name].shape[0] < committed:
            raise DataError(
                f"{learner}: committed {committed} rows but /{name} holds {f[name].shape[0]}"
            )
    return committed


def _checksum_names(f: h5py.File, schema: int, learner: str) -> list[str]:
    """The checksum datasets a file of ``schema`` must hold (checked for shape)."""
    if schema == 2:
        return [ROW_CRC]
    if schema < 2:
        return []
    names = [GRAD_CRC, RECORD_CRC] + ([SENT_CRC] if "sent" in f else [])
    numel = f["grad"].shape[1]
    for name in names[:1] + names[2:]:
        if name not in f:
            continue
        columns = int(f[name].attrs.get(BLOCK_ATTR, 0))
        if columns < 1 or f[name].ndim != 2 or f[name].shape[1] != -(-numel // columns):
            raise DataError(f"{learner}: /{name} does not fit the rows of /grad (damaged)")
    return names


def _record_damage(
    f: h5py.File,
    path: Path,
    rank: int,
    schema: int,
    steps: np.ndarray,
    losses: np.ndarray,
    sent_bytes: np.ndarray | None,
) -> Damage | None:
    """Rows whose step, loss or sent bytes do not match their CRC-32C (schema 3), or
    whose steps do not increase."""
    bad: list[int] = []
    reason = ""
    if schema >= 3 and len(steps):
        recorded = f[RECORD_CRC][: len(steps)]
        for row, expected in enumerate(recorded):
            extra = None if sent_bytes is None else float(sent_bytes[row])
            if record_checksum(int(steps[row]), float(losses[row]), extra) != int(expected):
                bad.append(row)
        reason = "their step, loss or sent bytes do not match their CRC-32C"
    if not bad and len(steps) > 1:
        bad = [int(r) + 1 for r in np.flatnonzero(np.diff(steps) <= 0)]
        reason = "their steps do not increase (damaged /step)"
    return Damage(path, rank, tuple(bad), reason, by_row=True) if bad else None
