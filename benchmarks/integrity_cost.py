"""What per-row CRC-32C checksums cost, measured side by side in one run.

1. Writer throughput (rows appended to a SWMR rank file, flushed per row, CRC-32C of
   each row) divided by a raw sequential write of the same bytes with numpy ``tofile``,
   and divided by the same writer with the checksum left out.
2. Read throughput of ``Capture.read_step`` (every row checked against its CRC-32C)
   divided by the same reads without the check.

Variants run in rotation, median per variant, so machine noise hits them alike.
Target (issue 12): writer >= 0.7 of raw ``tofile``.
Run: python benchmarks/integrity_cost.py [--numel 1048576] [--rows 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np


def _rotate(variants: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each variant, run in rotation ``repeats`` times."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=1 << 20, help="values per row")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from gradstat.store import layer_table, open_capture, writer
    from gradstat.store.writer import RankFileWriter

    data = np.random.default_rng(0).standard_normal((args.rows, args.numel), dtype=np.float32)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "out"

        def ours() -> None:
            with RankFileWriter(path, 0, args.numel) as w:
                for i in range(args.rows):
                    w.append(i, 0.0, data[i])

        def no_checksum() -> None:
            def zeros(row: np.ndarray, columns: int) -> np.ndarray:
                return np.zeros(-(-row.size // columns), dtype=np.uint32)

            with mock.patch.object(writer, "block_checksums", zeros):
                ours()

        def raw_tofile() -> None:
            with open(path, "wb") as f:
                for i in range(args.rows):
                    data[i].tofile(f)
                    f.flush()

        write = _rotate({"crc": ours, "no crc": no_checksum, "tofile": raw_tofile}, args.repeats)
        run = Path(folder) / "run"
        layers = layer_table([("w", (args.numel,))])
        writer.write_capture(run, data[None], layers)
        with open_capture(run) as cap:

            def read_verified() -> None:
                for step in cap.steps:
                    cap.read_step(int(step))

            def read_unverified() -> None:
                source = cap._source(0, "grad")
                kept, source.checksums = source.checksums, None  # as schema 1: no checks
                try:
                    read_verified()
                finally:
                    source.checksums = kept

            read_verified()  # the first read_step imports torch
            read = _rotate({"verified": read_verified, "unverified": read_unverified}, args.repeats)

    mb = data.nbytes / 1e6
    print(f"{args.rows} rows of {args.numel:,} float32 values ({mb:.0f} MB), page cache")
    print(
        f"writer with CRC-32C / raw numpy tofile: {write['tofile'] / write['crc']:.3f}"
        "  (target >= 0.7)"
    )
    print(f"writer with CRC-32C / writer without:   {write['no crc'] / write['crc']:.3f}")
    print(f"read_step verified / unverified:       {read['unverified'] / read['verified']:.3f}")
    print(
        f"({mb / write['crc']:.0f} MB/s written, {mb / write['tofile']:.0f} MB/s tofile, "
        f"{mb / read['verified']:.0f} MB/s read verified, "
        f"{mb / read['unverified']:.0f} MB/s unverified)"
    )


if __name__ == "__main__":
    main()
