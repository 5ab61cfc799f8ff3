"""Lossless HDF5 compression of real gradient rows: ratio and writer speed vs raw.

Takes the rows of a float32 capture (every step of every learner, cycled to ``--rows``),
stores them as float32 and as bfloat16, and for each ``--compression`` writes them with
gradstat's own rank-file writer (SWMR, flushed per row, as during training). Prints the
compression ratio (raw bytes / file bytes) and the writer's throughput divided by a raw
numpy ``tofile`` of the same bytes, timed in pairs (raw, then the writer) and reported as
the median of the pairs' ratios over ``--repeats``. The machine is shared: only the
ratios measured side by side mean much.

Rule (issue 14): compression is on by default only if it keeps the writer >= 0.7 of raw.

    python benchmarks/storage_compression.py CAPTURE [--rows 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from gradstat import open_capture
from gradstat.store.compression import COMPRESSIONS
from gradstat.store.dtypes import float32_to_bfloat16_bits
from gradstat.store.writer import RankFileWriter


def real_rows(path: str, rows: int) -> tuple[np.ndarray, str]:
    with open_capture(path) as cap:
        found = [g.numpy() for _, grads in cap.iter_steps() for g in grads]
        label = f"{cap.workload} {cap.meta.get('size', '')} ({cap.numel:,} values)"
    return np.stack([found[i % len(found)] for i in range(rows)]), label


def seconds(write) -> float:
    started = time.perf_counter()
    write()
    return time.perf_counter() - started


def measure(data: np.ndarray, dtype: str, names: list[str], repeats: int) -> dict:
    stored = float32_to_bfloat16_bits(data) if dtype == "bfloat16" else data
    with tempfile.TemporaryDirectory() as folder:
        raw_path = Path(folder) / "raw"

        def raw() -> None:
            with open(raw_path, "wb") as f:
                for row in stored:
                    row.tofile(f)
                    f.flush()

        def writer(name: str):
            def write() -> None:
                w = RankFileWriter(Path(folder) / f"{name}.h5", 0, data.shape[1], dtype, name)
                for i, row in enumerate(stored):
                    w.append(i, 0.0, row)
                w.close()

            return write

        results = {}
        raw_times = []
        for name in names:  # raw timed right before each try: the same noise for both
            pairs = [(seconds(raw), seconds(writer(name))) for _ in range(repeats)]
            raw_times += [r for r, _ in pairs]
            size = (Path(folder) / f"{name}.h5").stat().st_size
            results[name] = {
                "ratio": stored.nbytes / size,
                "speed": statistics.median(r / t for r, t in pairs),
                "mbps": stored.nbytes / statistics.median(t for _, t in pairs) / 1e6,
            }
        results["raw_mbps"] = stored.nbytes / statistics.median(raw_times) / 1e6
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("capture", help="a float32 capture folder")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    names = list(COMPRESSIONS)
    try:
        import hdf5plugin  # noqa: F401
    except ImportError:
        names = [n for n in names if n not in ("lz4", "zstd")]
        print("(hdf5plugin not installed: lz4 and zstd skipped)")
    data, label = real_rows(args.capture, args.rows)
    print(f"{label}: {args.rows} rows of {data.shape[1] * 4 / 2**20:.1f} MiB (float32)")
    print("| stored as | compression | size ratio (raw / file) | writer speed / raw tofile |")
    print("|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        results = measure(data, dtype, names, args.repeats)
        for name in names:
            r = results[name]
            speed = f"{r['speed']:.2f} ({r['mbps']:.0f} MB/s)"
            print(f"| {dtype} | {name} | {r['ratio']:.3f} | {speed} |")
        print(f"| {dtype} | raw tofile | 1 | 1 ({results['raw_mbps']:.0f} MB/s) |")


if __name__ == "__main__":
    main()
