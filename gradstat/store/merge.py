"""Joining the parts of a multi-node capture written without a shared file system.

Each node writes its learners' rank files into its own ``--out`` folder; node 0's also
holds ``capture.h5``. ``merge_parts`` brings every rank file into one folder by hard
link (no data copied, the parts stay as they were) or, with ``move``, by renaming (on
another file system: one copy, then the source is removed), never by copying twice.
``capture.h5`` (metadata only) is copied, then its virtual datasets are written over
the joined rank files, and the result is opened and checked like any capture.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import h5py

from gradstat.errors import DataError, UsageError
from gradstat.store.ranks import format_ranks
from gradstat.store.schema import ROOT_FILE, rank_file_name, recorded_ranks

RANK_FILE = re.compile(r"rank-(\d+)\.h5")
LOG_FILE = re.compile(r"capture(-node\d+)?\.log")


def _rank_files(part: Path) -> dict[int, Path]:
    return {
        int(m.group(1)): path
        for path in sorted(part.iterdir())
        if (m := RANK_FILE.fullmatch(path.name))
    }


def _place(source: Path, target: Path, move: bool) -> None:
    """Hard-link (or move) ``source`` to ``target``; never a second copy of the data."""
    if target.exists():
        if target.resolve() == source.resolve() or os.path.samefile(source, target):
            return
        raise UsageError(f"{target} already exists; merge into a new folder")
    if move:
        shutil.move(source, target)  # a rename; across file systems one copy + remove
        return
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise UsageError(
                f"{source} is on another file system than {target.parent}: a hard link is "
                "impossible; pass --move to move the rank files instead"
            ) from None
        raise DataError(f"cannot link {source} to {target}: {exc.strerror}") from None


def _learner_files(parts: list[Path], expected: list[int], root: Path) -> dict[int, Path]:
    """Each expected learner's rank file among ``parts``: a ``UsageError`` for a learner
    in two parts, one in none, or one the root file does not list."""
    files: dict[int, Path] = {}
    for part in parts:
        for rank, path in _rank_files(part).items():
            if rank in files and not os.path.samefile(files[rank], path):
                raise UsageError(
                    f"learner {rank} has a rank file in {files[rank].parent} and {part}"
                )
            files[rank] = path
    missing = [r for r in expected if r not in files]
    if missing:
        raise UsageError(
            f"no part holds the rank files of learners {format_ranks(missing)}; "
            "give every node's folder"
        )
    extra = sorted(set(files) - set(expected))
    if extra:
        raise UsageError(
            f"learners {format_ranks(extra)} have rank files but are not in {root / ROOT_FILE}"
        )
    return files


def merge_parts(dest: str | os.PathLike, parts: Sequence[str | os.PathLike], move: bool = False):
    """Join ``parts`` (capture folders of the nodes of one run) into ``dest``.

    ``dest`` is a new or empty folder, or one of the parts (the others join it).
    Returns the opened, checked :class:`~gradstat.store.reader.Capture` (close it).
    """
    from gradstat.store.reader import open_capture

    dest = Path(dest)
    parts = list({Path(p).resolve(): Path(p) for p in parts}.values())  # each part once
    for part in parts:
        if not part.is_dir():
            raise UsageError(f"{part}: not a folder (give the nodes' capture folders)")
    roots = [part for part in parts if (part / ROOT_FILE).exists()]
    if len(roots) != 1:
        found = ", ".join(str(p) for p in roots) or "none"
        raise UsageError(f"exactly one part must hold {ROOT_FILE} (node 0's folder); found {found}")
    (root,) = roots
    with h5py.File(root / ROOT_FILE, "r") as f:
        expected = recorded_ranks(f.attrs)
    files = _learner_files(parts, expected, root)
    in_place = dest.exists() and any(dest.resolve() == p.resolve() for p in parts)
    if dest.exists() and not in_place and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} already exists and is not empty; merge into a new folder")
    dest.mkdir(parents=True, exist_ok=True)
    if root.resolve() != dest.resolve():
        shutil.copy2(root / ROOT_FILE, dest / ROOT_FILE)
    for rank in expected:
        _place(files[rank], dest / rank_file_name(rank), move)
    for part in parts:
        for path in part.iterdir():
            if LOG_FILE.fullmatch(path.name):
                _place(path, dest / path.name, move)

    from gradstat.store.writer import finalize_root

    with h5py.File(dest / ROOT_FILE, "r") as f:
        status = str(f.attrs["status"])
    finalize_root(dest, status, virtual=status == "complete")
    return open_capture(dest)
