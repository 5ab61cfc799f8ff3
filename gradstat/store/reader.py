"""Reading captures: validate everything, trust only committed, checked rows.

Opening a capture reads and checks its metadata first, in a child process with a time
limit (gradstat/store/index.py, guard.py); rows are then read on demand, each value
checked against its CRC-32C (gradstat/store/rows.py). Rank files closed cleanly are
read in plain mode; those still flagged "open for write" (being written, or their
writer killed) in SWMR-read mode (docs/format.md), where virtual datasets cannot resolve.
"""

from __future__ import annotations

import json
import os
import re
import socket
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from gradstat.errors import DamagedData, DataError, GradstatWarning, UsageError
from gradstat.store.attrs import integer, json_attr, number
from gradstat.store.compression import ensure_readable
from gradstat.store.dtypes import DISK_DTYPES, bfloat16_bits_to_float32
from gradstat.store.guard import bounded
from gradstat.store.index import CaptureIndex, RankIndex, read_index
from gradstat.store.picking import LearnersSpec, StepsSpec, select_learners, select_steps
from gradstat.store.ranks import format_ranks
from gradstat.store.rows import RowSource
from gradstat.store.schema import (
    BATCH_SIZE_ATTR,
    BLOCK_ATTR,
    GRAD_CRC,
    ROOT_FILE,
    ROW_CRC,
    SCHEMA_VERSION,
    SENT_CRC,
    rank_file_name,
)
from gradstat.store.scope import Scope, resolve_scopes
from gradstat.store.verify import Damage

if TYPE_CHECKING:  # torch loads on first use: `gradstat info` and --help never need it
    import torch

#: What schemas before 3 leave unchecked, for the warning at open.
_UNCHECKED = {
    1: "no part of it is checksummed (rows are checked by file size only)",
    2: "its /step, /loss, /sent rows, layer table and which capture each rank file "
    "belongs to are not checksummed",
}


def _root_path(path: Path) -> Path:
    path = Path(path)
    if not str(path).strip() or not path.exists():
        raise UsageError(f"{path}: no such file or folder")
    if path.is_file() and re.fullmatch(r"rank-\d+\.h5", path.name):
        raise UsageError(
            f"{path} is one learner's rank file; pass the capture folder ({path.parent})"
        )
    if path.is_dir():
        folder, path = path, path / ROOT_FILE
        if not path.exists():
            ranks = sorted(int(p.name[5:-3]) for p in folder.glob("rank-*.h5"))
            if ranks:
                raise DataError(
                    f"{folder}: rank files of learners {format_ranks(ranks)} but no "
                    f"{ROOT_FILE}: a part written by a node other than node 0; join the "
                    f"parts with: gradstat merge DEST NODE0_FOLDER {folder} ..."
                )
            raise DataError(f"{folder}: not a gradstat capture (no {ROOT_FILE})")
    return path


def _process_alive(hostname: str, pid: int) -> bool:
    """Whether the writer process still runs (same host only; zombies count as dead)."""
    if hostname != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class Capture:
    """An opened capture: metadata, layer table, recorded steps and lazy gradient rows.

    Use as a context manager, or call :meth:`close`. ``read_step`` and ``read_row``
    load one step or one row at a time, so analyses stream, and check every value they
    hand out. A capture that is damaged or mismatched raises ``DataError`` naming file,
    learner and step, and one still being written warns that results cover the steps so
    far; ``allow_damaged`` (inspection: ``gradstat info``) opens a capture whose rows
    are damaged quietly, listing the damage in ``damage``.
    """

    def __init__(self, path: str | os.PathLike, *, allow_damaged: bool = False) -> None:
        root_path = _root_path(Path(path))
        self.root_path = root_path
        self.path = root_path.parent
        index: CaptureIndex = bounded(read_index, root_path)
        self.meta = index.meta
        # what the rows are checked as: the checksums every rank file carries, whatever
        # the schema attributes say (a relabelled file is checked all the same)
        self.schema = min((r.schema for r in index.ranks), default=index.schema)
        self.layers = index.layers
        self.world_size = int(self.meta["world_size"])  # the run's learners
        self.recorded_ranks = [r.rank for r in index.ranks]  # those with a rank file
        self._position = {rank: i for i, rank in enumerate(self.recorded_ranks)}
        self.dtype = str(self.meta["dtype"])
        self.workload = str(self.meta.get("workload", "unknown"))
        self.numel = self.layers[-1].stop
        self._index = index.ranks
        self._files: list[h5py.File] = []
        self._sources: dict[tuple[int, str], RowSource] = {}
        self.damage: list[Damage] = [r.damage for r in index.ranks if r.damage is not None]
        self._settle(index.ranks)
        if self.schema < SCHEMA_VERSION and not allow_damaged:
            warnings.warn(
                f"{root_path}: schema {self.schema}: {_UNCHECKED[self.schema]}",
                GradstatWarning,
                stacklevel=2,
            )
        try:
            for rank in index.ranks:
                mode = {"swmr": True} if rank.swmr else {}
                self._files.append(h5py.File(rank.path, "r", **mode))
            if self.damage and not allow_damaged:
                raise DamagedData(self.damage_report())
            if self.status == "running" and not allow_damaged:
                warnings.warn(
                    f"{self.path} is still being written (running: {len(self.steps)} steps "
                    "so far); the results cover those steps",
                    GradstatWarning,
                    stacklevel=2,
                )
        except OSError as exc:
            self.close()
            raise DataError(f"{self.path}: a rank file cannot be opened again ({exc})") from None
        except Exception:
            self.close()
            raise

    def _settle(self, ranks: list[RankIndex]) -> None:
        """The capture's steps (those committed on every learner), status and the
        checks across learners: equal steps, and ``committed`` as capture.h5 recorded."""
        committed = [r.committed for r in ranks]
        rows = min(committed) if committed else 0
        steps = ranks[0].steps[:rows] if ranks else np.zeros(0, np.int64)
        for r in ranks[1:]:
            if rows and not self.damage and not np.array_equal(r.steps[:rows], steps):
                raise DataError(
                    f"{r.path} (learner {r.rank}): recorded different steps than "
                    f"learner {ranks[0].rank} ({ranks[0].path.name})"
                )
        # complete only if the root says so and every rank file closed cleanly: the
        # root's status is a claim the rank files must bear out (a rewritten one too)
        closed = self.meta.get("status") == "complete" and all(r.closed for r in ranks)
        where = str(self.root_path)
        recorded = integer(self.meta, "committed", where, default=rows) if closed else rows
        if rows != recorded and not self.damage:
            short = min(ranks, key=lambda r: r.committed)
            raise DataError(
                f"{short.path} (learner {short.rank}): committed {short.committed} rows, but "
                f"{self.root_path} recorded {recorded} when the capture "
                "closed (damaged committed attribute?)"
            )
        self.steps = np.asarray(steps, dtype=np.int64)
        self.losses = (
            np.stack([r.losses[:rows] for r in ranks]) if ranks else np.zeros((0, 0))
        ).astype(np.float64)
        self.has_sent = bool(ranks) and all(r.sent_bytes is not None for r in ranks)
        self.sent_bytes = (
            np.stack([r.sent_bytes[:rows] for r in ranks])
            if self.has_sent
            else np.zeros((len(ranks), 0))
        )
        self.committed_per_learner = committed
        self._row_of = {int(s): i for i, s in enumerate(self.steps)}
        stopped = [f"{r.stopped} (learner {r.rank})" for r in ranks if r.stopped is not None]
        #: Why a writer stopped early, e.g. "disk full at step 12 (learner 1)", or None.
        self.stop_reason = stopped[0] if stopped else None
        running = any(not r.closed and _process_alive(r.hostname, r.writer_pid) for r in ranks)
        if self.damage:
            self.status = "damaged"
        elif self.meta.get("status") == "incomplete" or stopped:
            self.status = "incomplete"
        elif closed:
            self.status = "complete"
        elif running:
            self.status = "running"
        else:
            self.status = "interrupted"

    def damage_report(self) -> str:
        """One line per damaged file: which learner, which steps, why."""
        lines = [damage.describe(self._file_steps(damage.learner)) for damage in self.damage]
        return "; ".join(lines)

    def _file_steps(self, learner: int) -> np.ndarray:
        return self._index[self._position[learner]].steps

    def _damage_record(self, damage: Damage) -> dict:
        steps = self._file_steps(damage.learner)
        return {
            "file": str(damage.path),
            "learner": damage.learner,
            "rows": list(damage.rows),
            "steps": [int(steps[r]) for r in damage.rows if r < len(steps)],
            "reason": damage.reason,
        }

    @property
    def verification(self) -> str:
        """How rows are verified: by checksum (schemas 2 and 3), or by size only."""
        if self.schema >= 3:
            return "CRC-32C per chunk of every row, its step and loss, checked on every read"
        if self.schema == 2:
            return "CRC-32C per /grad row, checked on every read (schema 2)"
        return "file sizes and chunk extents only (schema 1 has no row checksums)"

    # --- metadata ---------------------------------------------------------------------
    @property
    def learners(self) -> list[int]:
        """The recorded learners, named by their rank in the run."""
        return list(self.recorded_ranks)

    @property
    def is_sample(self) -> bool:
        """Whether only some of the run's learners recorded (``--record-ranks``)."""
        return len(self.recorded_ranks) < self.world_size

    def learners_text(self) -> str:
        """``4 learners``, or ``2 of 8 learners (ranks 0,4)`` for a sample."""
        if not self.is_sample:
            return f"{self.world_size} learner" + ("s" if self.world_size != 1 else "")
        ranks = format_ranks(self.recorded_ranks)
        return f"{len(self.recorded_ranks)} of {self.world_size} learners (ranks {ranks})"

    @property
    def nbytes(self) -> int:
        """Bytes on disk: the root file plus every rank file."""
        files = [self.root_path] + [self.path / rank_file_name(r) for r in self.learners]
        return sum(p.stat().st_size for p in files if p.exists())

    @property
    def batch_size(self) -> int | None:
        """The per-learner batch size the run recorded (root attribute ``batch_size``),
        or None where the capture does not say; a ``DataError`` for a value that is not
        a positive integer."""
        value = self.meta.get(BATCH_SIZE_ATTR)
        if value is None:
            return None
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and np.isfinite(value) and value >= 1 and value == int(value)):
            raise DataError(f"{self.root_path}: batch_size {value!r} is not a positive integer")
        return int(value)

    @property
    def check_columns(self) -> int:
        """Columns each checksum of a row covers (schema 3: one HDF5 chunk; schema 2: the
        whole row; schema 1, unchecked: the chunk). Reads of column ranges whose ends
        are multiples of it check each value once; a range cut inside a checked block
        reads that block whole (gradstat/store/rows.py)."""
        if not self.recorded_ranks:
            return self.numel
        source = self._source(0, "grad")
        if self.schema >= 2:
            return source.block
        chunks = source.dataset.chunks
        return int(chunks[1]) if chunks else self.numel

    def scopes(self, spec: str = "model") -> list[Scope]:
        return resolve_scopes(self.layers, spec)

    def describe(self) -> dict:
        """A JSON-ready summary (what ``gradstat info --json`` prints)."""
        losses = self.losses[np.isfinite(self.losses)] if self.losses.size else self.losses
        return {
            "path": str(self.path),
            "workload": self.workload,
            "status": self.status,
            "learners": len(self.learners),
            "world_size": self.world_size,
            "recorded_ranks": self.learners,
            "backend": self.meta.get("backend"),
            "data_parallel": self.meta.get("data_parallel", "ddp"),  # or fsdp2
            "dtype": self.dtype,
            "batch_size": self.meta.get(BATCH_SIZE_ATTR),
            "compression": self.meta.get("compression", "none"),
            "numel": self.numel,
            "steps": [int(s) for s in self.steps],
            "committed_per_learner": self.committed_per_learner,
            "stop_reason": self.stop_reason,
            "schema": self.schema,
            "verification": self.verification,
            "damage": [self._damage_record(damage) for damage in self.damage],
            "datasets": ["grad", "sent"] if self.has_sent else ["grad"],
            "compressor": self.compressor,
            "bytes": self.nbytes,
            "layers": [
                {
                    "name": layer.name,
                    "offset": layer.offset,
                    "numel": layer.numel,
                    "shape": list(layer.shape),
                }
                for layer in self.layers
            ],
            "loss": {
                "first": float(self.losses[:, 0].mean()) if self.losses.size else None,
                "last": float(self.losses[:, -1].mean()) if self.losses.size else None,
                "min": float(losses.min()) if losses.size else None,
                "max": float(losses.max()) if losses.size else None,
            },
            "created": self.meta.get("created"),
            "command": self.meta.get("command"),
            "versions": _versions(self.meta.get("versions")),
        }

    @property
    def compressor(self) -> dict | None:
        """The compression hook the capture trained with (``capture --compressor``), or
        ``None``: its name, ratio (``None`` for fixed-rate ones) and settings."""
        if "compressor" not in self.meta:
            return None
        where = str(self.root_path)
        ratio = number(self.meta, "compressor_ratio", where, float("nan"))
        if not (np.isnan(ratio) or 0 < ratio < 1):
            raise DataError(f"{where}: attribute compressor_ratio = {ratio!r} is no density")
        settings = json_attr(self.meta, "compressor_settings", where, "{}")
        if not isinstance(settings, dict):
            raise DataError(f"{where}: attribute compressor_settings is not a JSON object")
        return {
            "name": str(self.meta["compressor"]),
            "ratio": None if np.isnan(ratio) else ratio,
            "settings": settings,
        }

    # --- data -------------------------------------------------------------------------
    def _learner_list(self, learners: Sequence[int] | None) -> list[int]:
        if learners is None:
            return self.learners
        for learner in learners:
            if learner not in self._position:
                raise UsageError(
                    f"learner {learner} is not in the capture "
                    f"(recorded: {format_ranks(self.learners)})"
                )
        return list(learners)

    def read_step(
        self, step: int, learners: Sequence[int] | None = None, dataset: str = "grad"
    ) -> torch.Tensor:
        """Gradients of one recorded training step: float32 tensor ``(learners, numel)``.

        ``dataset="sent"`` reads what each learner contributed after compression instead
        (captures trained with a compression hook, ``has_sent``).
        """
        if dataset not in ("grad", "sent"):
            raise UsageError(f"dataset must be grad or sent, got {dataset!r}")
        if dataset == "sent" and not self.has_sent:
            raise UsageError(f"{self.path} holds no sent rows (not trained with --compressor)")
        chosen = self._learner_list(learners)
        out = np.empty((len(chosen), self.numel), dtype=np.float32)
        for i, learner in enumerate(chosen):
            self._read(step, learner, 0, self.numel, out[i], dataset)
        import torch

        return torch.from_numpy(out)

    def read_row(
        self,
        step: int,
        learner: int,
        out: np.ndarray | None = None,
        columns: slice | None = None,
    ) -> np.ndarray:
        """One learner's gradient at one recorded step as float32, checked.

        ``columns``: a contiguous ``slice(start, stop)`` of the flat vector (default: all);
        ``out``: a preallocated float32 array of that length to read into (no
        temporary for float32 captures), else a new one. Analyses reuse one ``out`` per
        row so that a step never holds more than the rows it needs.
        """
        start, stop, stride = (columns or slice(None)).indices(self.numel)
        if stride != 1:
            raise ValueError("columns must be a contiguous slice")
        width = max(0, stop - start)
        if out is None:
            out = np.empty(width, dtype=np.float32)
        elif out.shape != (width,) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 array of {width} values")
        self._read(step, learner, start, stop, out, "grad")
        return out

    def _read(
        self, step: int, learner: int, start: int, stop: int, out: np.ndarray, name: str
    ) -> None:
        """Columns ``[start, stop)`` of a learner's row of dataset ``name`` at ``step``,
        checked, as float32 into ``out``."""
        row = self._row_of.get(int(step))
        if row is None:
            raise UsageError(f"step {step} is not a committed step of this capture")
        (learner,) = self._learner_list([learner])
        if stop <= start:
            return
        source = self._source(self._position[learner], name)
        if self.dtype == "float32":
            source.read(row, int(step), start, stop, out)
            return
        stored = np.empty(stop - start, dtype=DISK_DTYPES[self.dtype])
        source.read(row, int(step), start, stop, stored)
        if self.dtype == "bfloat16":
            bfloat16_bits_to_float32(stored, out)
        else:
            out[...] = stored

    def _source(self, position: int, name: str) -> RowSource:
        """The checked reader of dataset ``name`` of the ``position``-th rank file, kept
        for the capture's life."""
        key = (position, name)
        if key not in self._sources:
            f = self._files[position]
            checksums, block = None, None
            crc_name = {"grad": GRAD_CRC, "sent": SENT_CRC}[name]
            schema = self._index[position].schema
            if schema >= 3:
                checksums = f[crc_name]
                block = int(checksums.attrs[BLOCK_ATTR])
            elif schema == 2 and name == "grad":
                checksums = f[ROW_CRC]
            learner = self.recorded_ranks[position]
            path = self.path / rank_file_name(learner)
            ensure_readable(f[name], path)
            self._sources[key] = RowSource(path, learner, f[name], checksums, block)
        return self._sources[key]

    def verify_rows(self) -> list[Damage]:
        """Read every committed row of every learner (and its /sent row) and check it
        against its checksums; adds what fails to ``damage`` (``gradstat info
        --verify``). Reads the whole capture, one row at a time."""
        found = []
        stored = np.empty(self.numel, dtype=DISK_DTYPES[self.dtype])
        names = ["grad", "sent"] if self.has_sent else ["grad"]
        for position, learner in enumerate(self.recorded_ranks):
            if any(d.learner == learner for d in self.damage):
                continue
            index = self._index[position]
            bad = []
            for row in range(index.committed):
                step = int(index.steps[row])
                try:
                    for name in names:
                        self._source(position, name).read(row, step, 0, self.numel, stored)
                except DataError:
                    bad.append(row)
            if bad:
                found.append(
                    Damage(index.path, learner, tuple(bad), "rows do not match their CRC-32C")
                )
        self.damage += found
        if found:
            self.status = "damaged"
        return found

    def iter_steps(
        self, steps: StepsSpec = None, learners: LearnersSpec = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(step, grads[learners, numel])`` one step at a time; ``steps`` and
        ``learners`` as everywhere (``"::25"``, ``"0,2"``, lists; None: all)."""
        chosen = None if learners is None else select_learners(self.learners, learners)
        for step in self.steps if steps is None else select_steps(self.steps, steps):
            yield int(step), self.read_step(int(step), chosen)

    def close(self) -> None:
        self._sources = {}
        for f in self._files:
            if f.id.valid:
                f.close()
        self._files = []

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Capture({str(self.path)!r}, learners={len(self.learners)}/{self.world_size}, "
            f"steps={len(self.steps)}, "
            f"numel={self.numel}, status={self.status!r})"
        )


def _versions(text: object) -> object:
    """The ``versions`` attribute: a JSON object of versions, else its text as it is
    (it only informs; another writer may put anything there)."""
    if text is None:
        return None
    try:
        return json.loads(str(text))
    except ValueError:
        return str(text)


def open_capture(path: str | os.PathLike, *, allow_damaged: bool = False) -> Capture:
    """Open a capture folder (or its ``capture.h5``) for reading."""
    return Capture(path, allow_damaged=allow_damaged)
