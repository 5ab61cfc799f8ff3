"""Reading captures: validate the schema, trust only committed rows, load lazily.

Rank files are always opened directly in SWMR-read mode (DESIGN.md): that works on a
complete capture, on one still being written, and on one whose writer was killed (where
plain read mode fails on the "open for write" flag and virtual datasets cannot resolve).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

import h5py
import numpy as np
import torch

from gradstat.errors import DataError, UsageError
from gradstat.store.compression import ensure_readable
from gradstat.store.dtypes import DISK_DTYPES, read_row
from gradstat.store.ranks import format_ranks
from gradstat.store.schema import (
    FORMAT_NAME,
    ROOT_FILE,
    SCHEMA_VERSION,
    Layer,
    rank_file_name,
    recorded_ranks,
)
from gradstat.store.scope import Scope, resolve_scopes


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
    if path.is_dir():
        path = path / ROOT_FILE
        if not path.exists():
            raise DataError(f"{path.parent}: not a gradstat capture (no {ROOT_FILE})")
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
    load one step (all selected learners) at a time, so analyses stream.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        root_path = _root_path(Path(path))
        self.root_path = root_path
        self.path = root_path.parent
        with _open_h5(root_path) as root:
            attrs = dict(root.attrs)
            if attrs.get("format") != FORMAT_NAME or "schema" not in attrs:
                raise DataError(f"{root_path}: an HDF5 file, but not a gradstat capture")
            if int(attrs["schema"]) != SCHEMA_VERSION:
                raise DataError(
                    f"{root_path}: capture schema {int(attrs['schema'])} is not supported "
                    f"(this gradstat reads schema {SCHEMA_VERSION})"
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
        self._files: list[h5py.File] = []
        try:
            self._open_ranks()
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
                for name in ("step", "loss"):
                    if f[name].shape[0] < rows:
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
            if rows and not np.array_equal(f["step"][:rows], steps):
                raise DataError(
                    f"{self.path}: learner {rank} recorded different steps than "
                    f"learner {self.recorded_ranks[0]}"
                )
        self.steps = np.asarray(steps, dtype=np.int64)
        self.losses = np.asarray(losses, dtype=np.float64)
        self.committed_per_learner = committed
        self._row_of = {int(s): i for i, s in enumerate(self.steps)}
        if self.meta.get("status") == "complete":
            self.status = "complete"
        elif running:
            self.status = "running"
        else:
            self.status = "interrupted"

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
            "dtype": self.dtype,
            "compression": self.meta.get("compression", "none"),
            "numel": self.numel,
            "steps": [int(s) for s in self.steps],
            "committed_per_learner": self.committed_per_learner,
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

    def read_step(self, step: int, learners: Sequence[int] | None = None) -> torch.Tensor:
        """Gradients of one recorded training step: float32 tensor ``(learners, numel)``."""
        row = self._row_of.get(int(step))
        if row is None:
            raise UsageError(f"step {step} is not a committed step of this capture")
        chosen = self._learner_list(learners)
        out = np.empty((len(chosen), self.numel), dtype=np.float32)
        for i, learner in enumerate(chosen):
            read_row(self._files[self._position[learner]]["grad"], row, out[i], self.dtype)
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
        row = self._row_of.get(int(step))
        if row is None:
            raise UsageError(f"step {step} is not a committed step of this capture")
        (learner,) = self._learner_list([learner])
        start, stop, stride = (columns or slice(None)).indices(self.numel)
        if stride != 1:
            raise ValueError("columns must be a contiguous slice")
        width = max(0, stop - start)
        if out is None:
            out = np.empty(width, dtype=np.float32)
        elif out.shape != (width,) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 array of {width} values")
        if width:
            dataset = self._files[self._position[learner]]["grad"]
            read_row(dataset, row, out, self.dtype, slice(start, stop))
        return out

    def iter_steps(
        self, steps: Sequence[int] | None = None, learners: Sequence[int] | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(step, grads[learners, numel])`` one step at a time."""
        for step in self.steps if steps is None else steps:
            yield int(step), self.read_step(int(step), learners)

    def close(self) -> None:
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


def open_capture(path: str | os.PathLike) -> Capture:
    """Open a capture folder (or its ``capture.h5``) for reading."""
    return Capture(path)
