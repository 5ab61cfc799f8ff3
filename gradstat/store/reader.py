"""Reading captures: validate the schema, trust only committed rows, load lazily.

Rank files are always opened directly in SWMR-read mode (docs/format.md): that works on a
complete capture, on one still being written, and on one whose writer was killed (where
plain read mode fails on the "open for write" flag and virtual datasets cannot resolve).
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

from gradstat.errors import DataError, GradstatWarning, UsageError
from gradstat.store.compression import ensure_readable
from gradstat.store.direct import DirectRows
from gradstat.store.dtypes import DISK_DTYPES, read_row
from gradstat.store.picking import LearnersSpec, StepsSpec, select_learners, select_steps
from gradstat.store.ranks import format_ranks
from gradstat.store.schema import (
    FORMAT_NAME,
    READABLE_SCHEMAS,
    ROOT_FILE,
    Layer,
    rank_file_name,
    recorded_ranks,
)
from gradstat.store.scope import Scope, resolve_scopes
from gradstat.store.verify import CHECKSUM_DATASET, Damage, check_row, structural_damage

if TYPE_CHECKING:  # torch loads on first use: `gradstat info` and --help never need it
    import torch

#: Rows read in column blocks whose running checksum is kept until their last block.
_PARTIAL_ROWS = 4096


def _open_h5(path: Path, **kwargs) -> h5py.File:
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not h5py.is_hdf5(path):
        raise DataError(f"{path}: not an HDF5 file")
    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as exc:
        reason = str(exc).split("(")[0].strip() or type(exc).__name__
        raise DataError(f"{path}: cannot be read, truncated or damaged? ({reason})") from exc


def _root_path(path: Path) -> Path:
    path = Path(path)
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

    Use as a context manager, or call :meth:`close`. ``read_step`` and ``iter_steps``
    load one step (all selected learners) at a time, so analyses stream, and verify
    every row they read (gradstat/store/verify.py). A capture whose committed rows are
    not all on disk raises ``DataError`` naming file, learner and steps, and one still
    being written warns that results cover the steps so far; ``allow_damaged``
    (inspection: ``gradstat info``) opens both quietly, listing damage in ``damage``.
    """

    def __init__(self, path: str | os.PathLike, *, allow_damaged: bool = False) -> None:
        root_path = _root_path(Path(path))
        self.root_path = root_path
        self.path = root_path.parent
        with _open_h5(root_path) as root:
            attrs = dict(root.attrs)
            if attrs.get("format") != FORMAT_NAME or "schema" not in attrs:
                raise DataError(f"{root_path}: an HDF5 file, but not a gradstat capture")
            if int(attrs["schema"]) not in READABLE_SCHEMAS:
                raise DataError(
                    f"{root_path}: capture schema {int(attrs['schema'])} is not supported "
                    f"(this gradstat reads schemas {', '.join(map(str, READABLE_SCHEMAS))})"
                )
            try:
                self.layers = self._read_layers(root)
            except KeyError as exc:
                raise DataError(f"{root_path}: the layer table is missing or damaged") from exc
        self.meta = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in attrs.items()}
        self.world_size = int(self.meta["world_size"])  # the run's learners
        self.recorded_ranks = recorded_ranks(self.meta)  # those with a rank file
        self._position = {rank: i for i, rank in enumerate(self.recorded_ranks)}
        self.dtype = str(self.meta["dtype"])
        if self.dtype not in DISK_DTYPES:
            raise DataError(f"{root_path}: unknown storage dtype {self.dtype!r}")
        self.workload = str(self.meta.get("workload", "unknown"))
        self.numel = self.layers[-1].stop if self.layers else 0
        self.schema = int(attrs["schema"])
        self._files: list[h5py.File] = []
        self._checksums: list[h5py.Dataset | None] = []
        #: (file position, dataset name) -> its DirectRows, or the dataset where HDF5 reads
        self._datasets: dict[tuple[int, str], DirectRows | h5py.Dataset] = {}
        #: (file position, row) -> (columns read so far, their CRC-32C): column blocks
        self._partial: dict[tuple[int, int], tuple[int, int]] = {}
        self.damage: list[Damage] = []
        try:
            self._open_ranks()
            if self.damage and not allow_damaged:
                raise DataError(self.damage_report())
            if self.status == "running" and not allow_damaged:
                warnings.warn(
                    f"{self.path} is still being written (running: {len(self.steps)} steps "
                    "so far); the results cover those steps",
                    GradstatWarning,
                    stacklevel=3,
                )
        except Exception:
            self.close()
            raise

    @staticmethod
    def _read_layers(root: h5py.File) -> list[Layer]:
        group = root["layers"]
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in group["name"][()]]
        offsets, numels, shapes = group["offset"][()], group["numel"][()], group["shape"][()]
        return [
            Layer(name, int(o), int(n), tuple(int(s) for s in shape))
            for name, o, n, shape in zip(names, offsets, numels, shapes, strict=True)
        ]

    def _open_ranks(self) -> None:
        missing = [r for r in self.recorded_ranks if not (self.path / rank_file_name(r)).exists()]
        if missing:
            names = ", ".join(rank_file_name(r) for r in missing[:3])
            raise DataError(
                f"{self.path}: the rank files of learners {format_ranks(missing)} are missing "
                f"({names}{', ...' if len(missing) > 3 else ''}); if the capture was written "
                f"by several nodes into separate folders, join them: gradstat merge DEST "
                f"{self.path} OTHER_NODES_FOLDERS..."
            )
        committed, running = [], False
        for rank in self.recorded_ranks:
            path = self.path / rank_file_name(rank)
            f = _open_h5(path, swmr=True)
            self._files.append(f)
            try:
                grad = f["grad"]
                if grad.dtype != DISK_DTYPES[self.dtype]:
                    raise DataError(
                        f"{path}: /grad holds {grad.dtype}, capture.h5 says {self.dtype}"
                    )
                ensure_readable(grad, path)
                rows = int(f.attrs["committed"])
                for name in ("step", "loss", CHECKSUM_DATASET):
                    if name in f and f[name].shape[0] < rows:
                        raise KeyError(name)
            except KeyError as exc:
                raise DataError(f"{path}: not a gradstat rank file or damaged") from exc
            if grad.shape[1] != self.numel:
                raise DataError(
                    f"{path}: rows of {grad.shape[1]} values, layer table has {self.numel}"
                )
            if grad.shape[0] < rows:
                raise DataError(f"{path}: committed {rows} rows but holds {grad.shape[0]}")
            committed.append(rows)
            self._checksums.append(f.get(CHECKSUM_DATASET))
            damage = structural_damage(f, path, rank, rows)
            if damage is not None:
                self.damage.append(damage)
            if not bool(f.attrs.get("closed", True)):
                running |= _process_alive(
                    str(f.attrs.get("hostname", "")), int(f.attrs["writer_pid"])
                )
        rows = min(committed) if committed else 0
        steps = self._files[0]["step"][:rows] if rows else np.zeros(0, np.int64)
        losses = (
            np.stack([f["loss"][:rows] for f in self._files])
            if rows
            else np.zeros((len(self._files), 0))
        )
        for rank, f in zip(self.recorded_ranks[1:], self._files[1:], strict=True):
            if rows and not self.damage and not np.array_equal(f["step"][:rows], steps):
                raise DataError(
                    f"{self.path}: learner {rank} recorded different steps than "
                    f"learner {self.recorded_ranks[0]}"
                )
        self.steps = np.asarray(steps, dtype=np.int64)
        self.losses = np.asarray(losses, dtype=np.float64)
        self.has_sent = bool(self._files) and all("sent" in f for f in self._files)
        self.sent_bytes = (
            np.stack([f["sent_bytes"][:rows] for f in self._files])
            if self.has_sent and rows
            else np.zeros((len(self._files), 0))
        )
        self.committed_per_learner = committed
        self._row_of = {int(s): i for i, s in enumerate(self.steps)}
        stopped = [
            f"{f.attrs['stopped']} (learner {rank})"
            for rank, f in zip(self.recorded_ranks, self._files, strict=True)
            if "stopped" in f.attrs
        ]
        #: Why a writer stopped early, e.g. "disk full at step 12 (learner 1)", or None.
        self.stop_reason = stopped[0] if stopped else None
        if self.damage:
            self.status = "damaged"
        elif self.meta.get("status") == "complete":
            self.status = "complete"
        elif self.meta.get("status") == "incomplete" or stopped:
            self.status = "incomplete"
        elif running:
            self.status = "running"
        else:
            self.status = "interrupted"

    def damage_report(self) -> str:
        """One line per damaged file: which learner, which steps, why."""
        lines = [damage.describe(self._file_steps(damage.learner)) for damage in self.damage]
        return "; ".join(lines)

    def _file_steps(self, learner: int) -> np.ndarray:
        position = self._position[learner]
        try:
            return self._files[position]["step"][: self.committed_per_learner[position]]
        except (OSError, IndexError):
            return np.zeros(0, np.int64)

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
        """How rows are verified: by checksum (schema 2), or by size only (schema 1)."""
        if all(c is not None for c in self._checksums):
            return "CRC-32C per row, checked on every read"
        return f"file sizes and chunk extents only (schema {self.schema} has no row checksums)"

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
            return f"{self.world_size} learners"
        ranks = format_ranks(self.recorded_ranks)
        return f"{len(self.recorded_ranks)} of {self.world_size} learners (ranks {ranks})"

    @property
    def nbytes(self) -> int:
        """Bytes on disk: the root file plus every rank file."""
        files = [self.root_path] + [self.path / rank_file_name(r) for r in self.learners]
        return sum(p.stat().st_size for p in files if p.exists())

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
            "versions": json.loads(self.meta["versions"]) if "versions" in self.meta else None,
        }

    @property
    def compressor(self) -> dict | None:
        """The compression hook the capture trained with (``capture --compressor``), or
        ``None``: its name, ratio (``None`` for fixed-rate ones) and settings."""
        if "compressor" not in self.meta:
            return None
        ratio = float(self.meta.get("compressor_ratio", float("nan")))
        return {
            "name": str(self.meta["compressor"]),
            "ratio": None if np.isnan(ratio) else ratio,
            "settings": json.loads(self.meta.get("compressor_settings", "{}")),
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
        row = self._row_of.get(int(step))
        if row is None:
            raise UsageError(f"step {step} is not a committed step of this capture")
        chosen = self._learner_list(learners)
        out = np.empty((len(chosen), self.numel), dtype=np.float32)
        for i, learner in enumerate(chosen):
            position = self._position[learner]
            source, direct = self._dataset(position, dataset)
            checked = dataset == "grad" and self._checksums[position] is not None
            stored, crc = read_row(
                source, row, out[i], self.dtype, direct=direct, crc_from=0 if checked else None
            )
            if checked:  # only grad rows carry a checksum
                self._verify(position, row, int(step), stored, crc)
        import torch

        return torch.from_numpy(out)

    def read_row(
        self,
        step: int,
        learner: int,
        out: np.ndarray | None = None,
        columns: slice | None = None,
    ) -> np.ndarray:
        """One learner's gradient at one recorded step as float32, straight from the file.

        ``columns``: a contiguous ``slice(start, stop)`` of the flat vector (default: all);
        ``out``: a preallocated float32 array of that length to read into (HDF5 copies
        into it directly, no temporary), else a new one. Analyses reuse one ``out`` per
        row so that a step never holds more than the rows it needs.
        """
        row, position, start, stop = self._locate(step, learner, columns)
        width = max(0, stop - start)
        if out is None:
            out = np.empty(width, dtype=np.float32)
        elif out.shape != (width,) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 array of {width} values")
        if width:
            dataset, direct = self._dataset(position, "grad")
            crc_from = self._crc_before(position, row, start)
            stored, crc = read_row(
                dataset, row, out, self.dtype, slice(start, stop), direct, crc_from
            )
            if crc is not None:
                self._checked_up_to(position, row, int(step), stop, stored, crc)
        return out

    def row_view(self, step: int, learner: int, columns: slice) -> np.ndarray | None:
        """:meth:`read_row` of ``columns`` without the copy: a view of the bytes in the
        page cache (the rank file mapped copy-on-write), checked the same way (its
        CRC-32C, running on from block to block); None where the row must be read into
        a buffer instead (a capture stored in another type than float32, compressed, or
        whose chunks of these columns are not one run in the file). Give the view back
        with :meth:`forget_view` once done with it."""
        row, position, start, stop = self._locate(step, learner, columns)
        _, direct = self._dataset(position, "grad")
        if direct is None or self.dtype != "float32" or stop <= start:
            return None
        crc_from = self._crc_before(position, row, start)
        seen = direct.view(row, start, stop, crc_from)
        if seen is None:
            return None
        view, crc = seen
        if crc is not None:
            self._checked_up_to(position, row, int(step), stop, view, crc)
        return view

    def _locate(self, step: int, learner: int, columns: slice | None) -> tuple[int, int, int, int]:
        """(row in the rank file, the file's position, first column, end column) of a
        step's row, checked: a committed step, a recorded learner, contiguous columns."""
        row = self._row_of.get(int(step))
        if row is None:
            raise UsageError(f"step {step} is not a committed step of this capture")
        (learner,) = self._learner_list([learner])
        start, stop, stride = (columns or slice(None)).indices(self.numel)
        if stride != 1:
            raise ValueError("columns must be a contiguous slice")
        return row, self._position[learner], start, stop

    def forget_view(self, learner: int, view: np.ndarray) -> None:
        """Give back the pages of a :meth:`row_view` of ``learner``'s rows: they stay in
        the page cache but no longer count as this process's resident memory."""
        kept = self._datasets.get((self._position[learner], "grad"))  # gone once closed
        if isinstance(kept, DirectRows):
            kept.forget(view)

    def _crc_before(self, position: int, row: int, start: int) -> int | None:
        """The CRC-32C of a row's columns before ``start`` when a read starting there
        can be checked: the row's first columns, or the columns right after the ones
        read last of that row (column blocks in order); else None (such a read relies
        on the file's structure alone)."""
        if self._checksums[position] is None:
            return None
        if start == 0:
            return 0
        partial = self._partial.get((position, row))
        return partial[1] if partial is not None and partial[0] == start else None

    def _checked_up_to(
        self, position: int, row: int, step: int, stop: int, stored: np.ndarray, crc: int
    ) -> None:
        """Columns ``[0, stop)`` of a row were read, their CRC-32C is ``crc``: check the
        row when that is all of it, else remember where the next block must start."""
        key = (position, row)
        self._partial.pop(key, None)
        if stop == self.numel:
            self._verify(position, row, step, stored, crc)
            return
        self._partial[key] = (stop, crc)
        while len(self._partial) > _PARTIAL_ROWS:  # rows never read to their end
            del self._partial[next(iter(self._partial))]

    def verify_rows(self) -> list[Damage]:
        """Read every committed row of every learner and check it against its CRC-32C;
        adds what fails to ``damage`` (``gradstat info --verify``). Reads the whole
        capture, one row at a time."""
        found = []
        buffer = np.empty(self.numel, dtype=np.float32)
        for position, learner in enumerate(self.recorded_ranks):
            if self._checksums[position] is None or any(d.learner == learner for d in self.damage):
                continue
            steps = self._file_steps(learner)
            dataset, direct = self._dataset(position, "grad")
            bad = []
            for row in range(self.committed_per_learner[position]):
                try:
                    stored, crc = read_row(
                        dataset, row, buffer, self.dtype, direct=direct, crc_from=0
                    )
                    self._verify(position, row, int(steps[row]), stored, crc)
                except (DataError, OSError):
                    bad.append(row)
            if bad:
                path = self.path / rank_file_name(learner)
                found.append(Damage(path, learner, tuple(bad), "rows do not match their CRC-32C"))
        self.damage += found
        if found:
            self.status = "damaged"
        return found

    def _dataset(self, position: int, name: str) -> tuple[h5py.Dataset, DirectRows | None]:
        """The ``position``-th rank file's dataset ``name`` and its direct reader (None
        where HDF5 must read it), both kept for the capture's life."""
        key = (position, name)
        if key not in self._datasets:
            learner = self.recorded_ranks[position]
            dataset = self._files[position][name]
            path = self.path / rank_file_name(learner)
            self._datasets[key] = DirectRows.usable(path, dataset) or dataset
        kept = self._datasets[key]
        return (kept.dataset, kept) if isinstance(kept, DirectRows) else (kept, None)

    def _verify(
        self, position: int, row: int, step: int, stored: np.ndarray, crc: int | None = None
    ) -> None:
        """Check a row of the ``position``-th rank file, as stored (before any
        conversion), against its CRC-32C (``crc``: already computed while reading)."""
        checksums = self._checksums[position]
        if checksums is not None:
            learner = self.recorded_ranks[position]
            path = self.path / rank_file_name(learner)
            check_row(path, learner, step, stored, int(checksums[row]), crc)

    def iter_steps(
        self, steps: StepsSpec = None, learners: LearnersSpec = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(step, grads[learners, numel])`` one step at a time; ``steps`` and
        ``learners`` as everywhere (``"::25"``, ``"0,2"``, lists; None: all)."""
        chosen = None if learners is None else select_learners(self.learners, learners)
        for step in self.steps if steps is None else select_steps(self.steps, steps):
            yield int(step), self.read_step(int(step), chosen)

    def close(self) -> None:
        for kept in self._datasets.values():
            if isinstance(kept, DirectRows):
                kept.close()
        self._datasets = {}
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


def open_capture(path: str | os.PathLike, *, allow_damaged: bool = False) -> Capture:
    """Open a capture folder (or its ``capture.h5``) for reading."""
    return Capture(path, allow_damaged=allow_damaged)
