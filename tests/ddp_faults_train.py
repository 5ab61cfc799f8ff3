"""A user's training script that gets GradientCapture wrong, run by the tests under torchrun.

``--fault accumulate``: two backwards per step without ``no_sync()``;
``--fault skip``: step 1 is skipped with ``continue`` before ``capture.step()``;
``--fault hooked``: the model already has a comm hook when GradientCapture is created.
Saves the all-reduced ``.grad`` of every step that reaches the optimizer
(``reference-rankN.npy``, with its step numbers in ``reference-steps.npy``).
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradstat import GradientCapture
from gradstat.capture.worker import exit_without_teardown
from gradstat.capture.workloads import build_workload
from gradstat.errors import UsageError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fault", choices=["accumulate", "skip", "hooked"], required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    workload = build_workload("digits", "tiny")
    ddp = DistributedDataParallel(workload.model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if args.fault == "hooked":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        try:
            GradientCapture(ddp, args.out)
        except UsageError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            dist.destroy_process_group()
            exit_without_teardown(3)
    capture = GradientCapture(ddp, args.out)
    batches = workload.batches(rank, dist.get_world_size(), 16, 0)
    reference, reference_steps = [], []
    for step in range(args.steps):
        optimizer.zero_grad()
        for _ in range(2 if args.fault == "accumulate" else 1):
            inputs, targets = next(batches)
            loss = workload.loss(ddp(inputs), targets)
            loss.backward()
        if args.fault == "skip" and step == 1:
            continue  # "a bad step": no optimizer.step(), and capture.step() forgotten
        reference.append(
            torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).numpy().copy()
        )
        reference_steps.append(step)
        optimizer.step()
        capture.step(step, loss.item())
    capture.close()
    np.save(args.out / f"reference-rank{rank}.npy", np.stack(reference))
    np.save(args.out / "reference-steps.npy", np.array(reference_steps))
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
