"""The forked metadata read (gradstat.store.guard) while other threads are inside h5py."""

from __future__ import annotations

import os
import threading

import h5py
import numpy as np
import pytest

from gradstat.errors import DataError
from gradstat.store.guard import bounded


def _read_attribute(path: str) -> int:
    with h5py.File(path, "r") as f:
        return int(f.attrs["answer"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the guard forks only where fork exists")
def test_forked_reads_finish_while_another_thread_reads_rows(tmp_path):
    """A thread reading rows holds h5py's lock most of the time; a child forked while it
    does must still be able to call h5py (h5py takes its lock around fork), else each
    read below hangs until its time limit and raises DataError."""
    path = tmp_path / "rows.h5"
    with h5py.File(path, "w") as f:
        f.attrs["answer"] = 42
        f.create_dataset("rows", data=np.arange(64 * 4096, dtype=np.float32).reshape(64, -1))
    stop = threading.Event()

    def read_rows() -> None:
        with h5py.File(path, "r") as f:
            while not stop.is_set():
                for i in range(64):
                    f["rows"][i]

    reader = threading.Thread(target=read_rows, daemon=True)
    reader.start()
    try:
        answers = [bounded(_read_attribute, str(path), timeout=20.0) for _ in range(20)]
    finally:
        stop.set()
        reader.join()
    assert answers == [42] * 20


def test_a_child_that_dies_is_an_error_naming_what_it_read():
    def die() -> None:
        os._exit(3)

    with pytest.raises(DataError, match="exit 3"):
        bounded(die)
