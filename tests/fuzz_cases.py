"""Damaged copies of a capture, and what gradstat makes of each (issue 30's fuzz run).

Used by tests/test_fuzz.py (a small seeded set, in the suite) and
benchmarks/fuzz_captures.py (a larger run with the command line, for the table).

A case is a named edit of a copy of a capture folder: truncations, bit flips in rows,
in rank-file metadata and in ``capture.h5``, zeroed pages, edited attributes and
tables, swapped, missing and foreign rank files, and *hostile* edits (issue 40): counts,
shapes and attributes a writer chose to mislead, with the identity checksum recomputed
(a CRC-32C is no signature), attributes of types gradstat does not know, a schema
relabelled over a changed value. :func:`outcome` reads the edited
copy through the library in a forked child with a time limit and classifies it:

* ``error``: a gradstat error whose message names a file of the capture;
* ``same``: everything read equals the undamaged capture's (the edit hit bytes that
  nothing reads);
* ``silent wrong``: it read, and something differs: the failure the checks exist for;
* ``unnamed error``, ``crash`` (another exception), ``hang``, ``signal``: failures too.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import select
import shutil
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from gradstat.errors import GradstatError
from gradstat.store.schema import ROOT_FILE, rank_file_name

OK = ("error", "same")


@dataclass(frozen=True)
class Case:
    kind: str
    name: str
    edit: Callable[[Path], None]


def digest(path: Path) -> str:
    """A hash of everything an analysis reads: steps, losses, layers, every row (and
    every /sent row). Raises what opening or reading raises."""
    from gradstat import open_capture

    h = hashlib.sha256()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with open_capture(path) as cap:
            h.update(np.asarray(cap.steps).tobytes())
            h.update(np.asarray(cap.losses).tobytes())
            h.update(repr([(la.name, la.offset, la.numel, la.shape) for la in cap.layers]).encode())
            h.update(repr((cap.world_size, cap.learners, cap.dtype)).encode())
            for step in cap.steps:
                h.update(cap.read_step(int(step)).numpy().tobytes())
                if cap.has_sent:
                    h.update(cap.read_step(int(step), dataset="sent").numpy().tobytes())
                    h.update(np.asarray(cap.sent_bytes).tobytes())
    return h.hexdigest()


def outcome(path: Path, expected: str, timeout: float = 60.0) -> tuple[str, str]:
    """(outcome, detail) of reading ``path`` (see the module docstring), in a forked
    child killed after ``timeout`` seconds."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            try:
                result = ("ok", digest(path))
            except GradstatError as exc:
                result = ("error", str(exc))
            except Exception as exc:
                result = ("crash", f"{type(exc).__name__}: {exc}")
            os.write(write_end, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(write_end)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "hang", f"no answer within {timeout:g} s"
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "signal", signal.Signals(os.WTERMSIG(status)).name
    kind, detail = pickle.loads(data)
    if kind == "ok":
        return ("same", "") if detail == expected else ("silent wrong", "the answer changed")
    if kind == "error":
        named = str(path) in detail and (ROOT_FILE in detail or "rank-" in detail)
        return ("error" if named else "unnamed error"), detail
    return kind, detail


# --- edits ---------------------------------------------------------------------------------


def _rank_files(path: Path) -> list[Path]:
    return sorted(path.glob("rank-*.h5"))


def _chunk_extents(file: Path, name: str = "grad") -> list[tuple[int, int, int]]:
    """(row, byte offset, size) of every chunk of dataset ``name``."""
    found = []
    with h5py.File(file, "r", swmr=True) as f:
        if name not in f:
            return []
        dataset = f[name]
        dataset.id.chunk_iter(
            lambda info: found.append((int(info.chunk_offset[0]), info.byte_offset, info.size))
        )
    return found


def flip(file: Path, at: int, mask: int = 0xFF) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))


def zero(file: Path, at: int, size: int = 4096) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(bytes(min(size, max(0, file.stat().st_size - at))))


def _attr(name: str, key: str, value) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        with h5py.File(path / name, "r+") as f:
            f.attrs[key] = value

    return edit


def _data(name: str, dataset: str, index, value) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        with h5py.File(path / name, "r+") as f:
            f[dataset][index] = value

    return edit


def _swap(a: str, b: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        os.rename(path / a, path / "swap.tmp")
        os.rename(path / b, path / a)
        os.rename(path / "swap.tmp", path / b)

    return edit


def make_cases(base: Path, foreign: Path | None, rng: np.random.Generator, n: int) -> list[Case]:
    """Edits of copies of ``base`` (a closed or killed capture): ``n`` random ones of each
    random kind, and the fixed ones (attributes, tables, swaps). ``foreign``: a capture
    of another run with the same layout, whose rank files are slipped in."""
    ranks = _rank_files(base)
    root = base / ROOT_FILE
    cases: list[Case] = []
    for file in [*ranks[:2], root]:
        size = file.stat().st_size
        for cut in sorted({0, 8, 40, 1024, 4096, size // 2, size - 1, size - 4096}):
            if 0 <= cut < size:
                cases.append(Case("truncation", f"{file.name} to {cut} B", _cut(file.name, cut)))
    for name in ("grad", "sent"):
        extents = [e for f in ranks for e in [(f, *x) for x in _chunk_extents(f, name)]]
        for _ in range(n if extents else 0):
            file, row, offset, size = extents[int(rng.integers(len(extents)))]
            at = offset + int(rng.integers(size))
            mask = 1 << int(rng.integers(8))
            label = f"{file.name} /{name} row {row} byte {at} bit {mask:#x}"
            cases.append(Case(f"{name} flip", label, _flip(file.name, at, mask)))
    for file in ranks[:2]:
        data_bytes = {b for _, o, s in _chunk_extents(file) for b in range(o, o + s, 4096)}
        metadata = [at for at in range(file.stat().st_size) if at // 4096 * 4096 not in data_bytes]
        for _ in range(n):
            at = int(rng.choice(metadata))
            cases.append(Case("metadata flip", f"{file.name} byte {at}", _flip(file.name, at)))
    for _ in range(n):
        at = int(rng.integers(root.stat().st_size))
        cases.append(Case("root flip", f"{ROOT_FILE} byte {at}", _flip(ROOT_FILE, at)))
    for file in [ranks[0], root]:
        pages = max(1, file.stat().st_size // 4096)
        for page in sorted(set(rng.integers(pages, size=n).tolist())):
            label = f"{file.name} page at {page * 4096}"
            cases.append(Case("zeroed page", label, _zero(file.name, page * 4096)))
    cases += _attribute_cases(base)
    cases += _table_cases(base)
    cases += _hostile_cases(base)
    if len(ranks) > 1:
        cases.append(
            Case(
                "swap", f"{ranks[0].name} <-> {ranks[1].name}", _swap(ranks[0].name, ranks[1].name)
            )
        )
        cases.append(Case("missing", f"no {ranks[1].name}", lambda p: (p / ranks[1].name).unlink()))
    if foreign is not None:
        for file in _rank_files(foreign)[:2]:
            cases.append(Case("foreign", f"{file.name} of another run", _copy_in(file)))
    return cases


def _cut(name: str, size: int) -> Callable[[Path], None]:
    return lambda path: os.truncate(path / name, size)


def _flip(name: str, at: int, mask: int = 0xFF) -> Callable[[Path], None]:
    return lambda path: flip(path / name, at, mask)


def _zero(name: str, at: int) -> Callable[[Path], None]:
    return lambda path: zero(path / name, at)


def _copy_in(file: Path) -> Callable[[Path], None]:
    return lambda path: shutil.copy(file, path / file.name)


def _attribute_cases(base: Path) -> list[Case]:
    r0, r1 = rank_file_name(0), rank_file_name(1)
    with h5py.File(base / r1, "r", swmr=True) as f:
        rows = int(f.attrs["committed"])
    edits = [
        (r1, "committed", -1),
        (r1, "committed", 0),
        (r1, "committed", rows - 1),
        (r1, "committed", rows + 1),
        (r1, "committed", 10**9),
        (r1, "rank", 0),
        (r0, "run_id", "0" * 32),
        (r0, "schema", 4),
        (ROOT_FILE, "schema", 1),
        (ROOT_FILE, "world_size", 1),
        (ROOT_FILE, "world_size", 0),
        (ROOT_FILE, "recorded_ranks", np.array([0, 1, 1])),
        (ROOT_FILE, "recorded_ranks", np.array([1, 0])),
        (ROOT_FILE, "dtype", "float16"),
        (ROOT_FILE, "dtype", "int8"),
        (ROOT_FILE, "status", "running"),
        (ROOT_FILE, "committed", rows + 3),
        (ROOT_FILE, "run_id", "f" * 32),
        (ROOT_FILE, "format", "other"),
    ]
    return [Case("attribute", f"{n}: {k} = {v!r}", _attr(n, k, v)) for n, k, v in edits]


def _table_cases(base: Path) -> list[Case]:
    r0 = rank_file_name(0)
    edits = [
        (ROOT_FILE, "layers/offset", 1, "+16"),
        (ROOT_FILE, "layers/numel", 0, "-1"),
        (ROOT_FILE, "layers/offset", 0, "+1"),
        (ROOT_FILE, "layers/name", 0, "x"),
        (r0, "step", 1, "=0"),
        (r0, "step", 2, "+1"),
        (r0, "loss", 1, "=0"),
        (r0, "grad_crc32c", (0, 0), "+1"),
        (r0, "record_crc32c", 0, "+1"),
    ]
    cases = []
    for name, dataset, index, change in edits:
        cases.append(
            Case(
                "table",
                f"{name}: {dataset}[{index}] {change}",
                _change(name, dataset, index, change),
            )
        )

    def shape(path: Path) -> None:  # same numel, another shape: only the checksum sees it
        with h5py.File(path / ROOT_FILE, "r+") as f:
            old = f["layers/shape"][0]
            f["layers/shape"][0] = np.array([int(np.prod(old))], dtype=np.int64)

    cases.append(Case("table", f"{ROOT_FILE}: layers/shape[0] flattened", shape))
    return cases


def _change(name: str, dataset: str, index, change: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        with h5py.File(path / name, "r+") as f:
            if dataset not in f:
                return
            data = f[dataset]
            first = index[0] if isinstance(index, tuple) else index
            if first >= data.shape[0]:
                return  # a smaller capture: nothing to edit
            if change.startswith("="):
                data[index] = type(data[index].item())(change[1:]) if change[1:] != "x" else "x"
            elif change == "x":
                data[index] = "x"
            else:
                value = data[index]
                data[index] = value + (int(change) if data.dtype.kind in "iu" else float(change))

    return edit


# --- hostile edits (issue 40): the checksum recomputed after each -----------------------


def resum(path: Path) -> None:
    """Recompute capture.h5's identity checksum from what it holds now (as a hostile
    writer would); nothing where the root is not readable as one."""
    from gradstat.store.checksums import identity_checksum

    with h5py.File(path / ROOT_FILE, "r+") as f:
        attrs = f.attrs
        if "checksum" not in attrs or not isinstance(attrs.get("world_size"), np.integer):
            return
        world = int(attrs["world_size"])
        ranks = [int(r) for r in attrs.get("recorded_ranks", range(min(world, 64)))]
        table = f["layers"]
        rows = zip(
            table["name"].asstr()[()],
            table["offset"][()],
            table["numel"][()],
            table["shape"][()],
            strict=True,
        )
        layers = [(n, int(o), int(k), [int(x) for x in shape]) for n, o, k, shape in rows]
        run_id, dtype = str(attrs["run_id"]), str(attrs["dtype"])
        attrs["checksum"] = np.int64(identity_checksum(run_id, world, ranks, dtype, layers))


def _hostile(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        edit(path)
        resum(path)

    return apply


def _layer_edit(index: int, shape: list[int], numel: int) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        with h5py.File(path / ROOT_FILE, "r+") as f:
            layers = f["layers"]
            i = index % layers["numel"].shape[0]
            layers["shape"][i] = np.array(shape, dtype=np.int64)
            layers["numel"][i] = numel

    return edit


def _foreign_attrs(path: Path) -> None:
    for file in [path / ROOT_FILE, *_rank_files(path)[:1]]:
        with h5py.File(file, "r+") as f:
            f.attrs["a_reference"] = f.ref
            f.attrs["a_compound"] = np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])
            f.attrs["versions"] = "not JSON {"
            f.attrs["batch_size"] = 32


def _relabel_and_flip(path: Path) -> None:
    """Every file relabelled schema 1, and one stored value changed."""
    for file in [path / ROOT_FILE, *_rank_files(path)]:
        with h5py.File(file, "r+") as f:
            f.attrs["schema"] = np.int64(1)
    with h5py.File(_rank_files(path)[0], "r+") as f:
        f["grad"][0, 7] = f["grad"][0, 7] + 1.0


def _drop_ranks(world: int) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        with h5py.File(path / ROOT_FILE, "r+") as f:
            f.attrs["world_size"] = np.int64(world)
            if "recorded_ranks" in f.attrs:
                del f.attrs["recorded_ranks"]

    return edit


def _hostile_cases(base: Path) -> list[Case]:
    r0 = rank_file_name(0)
    edits = [
        ("rank committed 1e12", _attr(r0, "committed", np.int64(10**12))),
        ("root committed 1e12", _attr(ROOT_FILE, "committed", np.int64(10**12))),
        ("world_size 5e7, no recorded_ranks", _drop_ranks(5 * 10**7)),
        ("world_size 40, no recorded_ranks", _drop_ranks(40)),
        ("world_size 2.5", _attr(ROOT_FILE, "world_size", 2.5)),
        ("world_size text", _attr(ROOT_FILE, "world_size", "two")),
        ("rank text", _attr(r0, "rank", "x")),
        ("negative shape", _layer_edit(-1, [-1, -1], 1)),
        ("shape product wraps", _layer_edit(-1, [2**62 + 1, 256], 256)),
        ("numel 1e12", _layer_edit(-1, [10**6, 10**6], 10**12)),
        ("unknown attribute types", _foreign_attrs),
        ("schema relabelled 1, value changed", _relabel_and_flip),
    ]
    return [Case("hostile", name, _hostile(edit)) for name, edit in edits]
