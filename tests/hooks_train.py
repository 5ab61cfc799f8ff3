"""Train 2 gloo learners with gradstat's compression hooks, one compressor after another,
run by the tests under torchrun (tests/test_hooks.py).

For each compressor it writes a capture ``OUT/NAME`` (``grad`` and ``sent`` rows) and
``OUT/NAME/applied-rankN.npy``: the gradient DDP left on the parameters each step (the
hook's aggregate, the update the optimizer applied), plus ``overhead-rankN.npy``.
"""

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradstat import GradientCapture
from gradstat.capture.worker import exit_without_teardown
from gradstat.capture.workloads import build_workload
from gradstat.hooks import compression_hook


def train(name: str, ratio: float, out: Path, steps: int, rank: int) -> None:
    torch.manual_seed(0)
    workload = build_workload("digits", "tiny")
    ddp = DistributedDataParallel(workload.model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    compressor, _, assignments = name.partition(":")
    params = {k: float(v) for k, v in (a.split("=") for a in assignments.split(":") if a)}
    hook, state = compression_hook(compressor, ratio=ratio, **params)
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
    parser.add_argument("--compressors", required=True)
    parser.add_argument("--ratio", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for name in args.compressors.split(","):
        train(name, args.ratio, args.out / name.replace(":", "_"), args.steps, dist.get_rank())
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
