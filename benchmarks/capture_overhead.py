"""Capture overhead, measured side by side in one run.

1. Training step time of real 2-learner gloo DDP training (charlm workload) with
   GradientCapture at every=1 and every=10, divided by the same training without
   capture. The three variants run interleaved in the same processes (blocks in
   rotation, median per variant) so machine noise hits them alike.
2. The background writer's throughput (rows appended to a SWMR rank file, flushed per
   row) divided by a raw sequential write of the same bytes with numpy ``tofile``.

Targets (issue 2): <= 1.05 at every=10, <= 1.3 at every=1, writer >= 0.7 of raw.
Run: python benchmarks/capture_overhead.py [--steps 30] [--blocks 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradstat import GradientCapture
    from gradstat.capture.worker import exit_without_teardown
    from gradstat.capture.workloads import build_workload

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    workload = build_workload("charlm", args.size)
    variants = {}
    for name in ("none", "every=1", "every=10"):
        torch.manual_seed(0)
        model = DistributedDataParallel(build_workload("charlm", args.size).model)
        capture = None
        if name != "none":
            capture = GradientCapture(model, Path(args.out) / name, every=int(name.split("=")[1]))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        variants[name] = (model, optimizer, capture, [])
    batches = workload.batches(rank, dist.get_world_size(), 32, 0)
    step = 0
    for block in range(args.blocks + 1):  # block 0 warms up
        for model, optimizer, capture, times in variants.values():
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.steps):
                inputs, targets = next(batches)
                loss = workload.loss(model(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if capture is not None:
                    capture.step(step, loss.item())
                step += 1
            dist.barrier()
            if block > 0:
                times.append((time.perf_counter() - started) / args.steps)
    for _, _, capture, _ in variants.values():
        if capture is not None:
            capture.close()
    if rank == 0:
        medians = {name: statistics.median(v[3]) for name, v in variants.items()}
        print("RESULT " + json.dumps(medians), flush=True)
    dist.destroy_process_group()
    exit_without_teardown()


def training_overhead(args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            __file__,
            "--worker",
            "--out",
            out,
            "--steps",
            str(args.steps),
            "--blocks",
            str(args.blocks),
            "--size",
            args.size,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        sys.exit(f"worker failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(lines[0][len("RESULT ") :])


def _median_seconds(write, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        write()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def writer_throughput(numel: int, rows: int, repeats: int) -> dict[str, float]:
    """Bytes per second of our rank-file writer and of two raw sequential writes."""
    from gradstat.store.writer import RankFileWriter

    data = np.random.default_rng(0).standard_normal((rows, numel), dtype=np.float32)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "out"

        def ours() -> None:
            writer = RankFileWriter(path, 0, numel)
            for i in range(rows):
                writer.append(i, 0.0, data[i])
            writer.close()

        def raw_tofile() -> None:
            with open(path, "wb") as f:
                for i in range(rows):
                    data[i].tofile(f)
                    f.flush()

        def raw_write() -> None:
            with open(path, "wb", buffering=0) as f:
                for i in range(rows):
                    f.write(memoryview(data[i]))

        return {
            name: data.nbytes / _median_seconds(fn, repeats)
            for name, fn in (("ours", ours), ("tofile", raw_tofile), ("write", raw_write))
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=20, help="training steps per block")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per variant")
    parser.add_argument("--size", default="small", help="charlm size: tiny, small, medium, large")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    times = training_overhead(args)
    base = times["none"]
    print(
        f"training step without capture: {base * 1e3:.1f} ms (charlm {args.size}, 2 gloo learners)"
    )
    for name in ("every=1", "every=10"):
        target = 1.3 if name == "every=1" else 1.05
        ratio = times[name] / base
        print(f"step time with capture {name:<9} / without: {ratio:.3f}  (target <= {target})")
    speed = writer_throughput(numel=1 << 20, rows=64, repeats=5)
    print(
        f"writer throughput / raw numpy tofile: {speed['ours'] / speed['tofile']:.3f}"
        "  (target >= 0.7)"
    )
    print(
        f"writer throughput / raw unbuffered write: {speed['ours'] / speed['write']:.3f}  "
        f"({speed['ours'] / 1e6:.0f} MB/s vs {speed['tofile'] / 1e6:.0f} and "
        f"{speed['write'] / 1e6:.0f} MB/s, 4 MiB rows, page cache, no fsync)"
    )


if __name__ == "__main__":
    main()
