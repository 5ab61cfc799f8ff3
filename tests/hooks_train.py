"""Train 2 gloo learners with gradstat's compression hooks, one compressor after another,
run by the tests under torchrun (tests/test_hooks.py).

Each run is ``SPEC@GRANULARITY`` (a compressor spec, ``+MEMORY`` included, and the plan's
granularity). DDP gets ``bucket_cap_mb=0.01``, so the digits CNN's gradients come in
several buckets (the bucket plan takes DDP's caps). For each run it writes a capture
``OUT/RUN`` (``grad`` and ``sent`` rows; ``RUN``: the run with ``:``, ``+``, ``/`` and
``@`` replaced) and ``OUT/RUN/applied-rankN.npy``: the gradient DDP left on the
parameters each step (the hook's aggregate, the update the optimizer applied), plus
``overhead-rankN.npy``.
"""

import argparse
import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradstat import GradientCapture
from gradstat.capture.worker import exit_without_teardown
from gradstat.capture.workloads import build_workload
from gradstat.hooks import compression_hook


def folder(run: str) -> str:
    """The capture folder's name of run ``SPEC@GRANULARITY``."""
    return re.sub(r"[:+/@]", "_", run)


def train(run: str, ratio: float, out: Path, steps: int, rank: int) -> None:
    spec, _, granularity = run.partition("@")
    torch.manual_seed(0)
    workload = build_workload("digits", "tiny")
    ddp = DistributedDataParallel(workload.model, bucket_cap_mb=0.01)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    hook, state = compression_hook(spec, ratio=ratio, granularity=granularity or "bucket")
    capture = GradientCapture(ddp, out, hook=hook, hook_state=state, meta={"workload": "test"})
    batches = workload.batches(rank, dist.get_world_size(), 16, 0)
    applied, overhead = [], []
    for step in range(steps):
        inputs, targets = next(batches)
        loss = workload.loss(ddp(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        applied.append(torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]))
        overhead.append(state.overhead_bytes)
        optimizer.step()
        capture.step(step, loss.item())
    capture.close()
    np.save(out / f"applied-rank{rank}.npy", torch.stack(applied).numpy())
    np.save(out / f"overhead-rank{rank}.npy", np.array(overhead, dtype=np.float64))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", required=True, help="SPEC@GRANULARITY,...")
    parser.add_argument("--ratio", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for run in args.runs.split(","):
        train(run, args.ratio, args.out / folder(run), args.steps, dist.get_rank())
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
