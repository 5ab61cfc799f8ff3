"""A user's training script that gets GradientCapture wrong, run by the tests under torchrun.

``--faults`` names the faults to train, one after another in one launch, each into
``OUT/FAULT`` with its stderr (every warning and error of that run) in
``OUT/FAULT-stderr-rankN.txt``:
``accumulate``: two backwards per step without ``no_sync()``;
``skip``: step 1 is skipped with ``continue`` before ``capture.step()``;
``hooked``: the model already has a comm hook when GradientCapture is created (its
error line goes to that stderr file; no capture is made).
Saves the all-reduced ``.grad`` of every step that reaches the optimizer
(``reference-rankN.npy``, with its step numbers in ``reference-steps.npy``).
"""

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
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

FAULTS = ("accumulate", "skip", "hooked")


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 (Python's and the libraries' writes alike) into ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as file:
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def train(fault: str, out: Path, steps: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    workload = build_workload("digits", "tiny")
    ddp = DistributedDataParallel(workload.model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if fault == "hooked":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        try:
            GradientCapture(ddp, out)
        except UsageError as exc:
            print(f"Error: {exc}", file=sys.stderr)
            return
    capture = GradientCapture(ddp, out)
    batches = workload.batches(rank, dist.get_world_size(), 16, 0)
    reference, reference_steps = [], []
    for step in range(steps):
        optimizer.zero_grad()
        for _ in range(2 if fault == "accumulate" else 1):
            inputs, targets = next(batches)
            loss = workload.loss(ddp(inputs), targets)
            loss.backward()
        if fault == "skip" and step == 1:
            continue  # "a bad step": no optimizer.step(), and capture.step() forgotten
        reference.append(
            torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).numpy().copy()
        )
        reference_steps.append(step)
        optimizer.step()
        capture.step(step, loss.item())
    capture.close()
    np.save(out / f"reference-rank{rank}.npy", np.stack(reference))
    np.save(out / "reference-steps.npy", np.array(reference_steps))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    args.out.mkdir(parents=True, exist_ok=True)
    for fault in args.faults.split(","):
        # a fresh filter: each run warns as in a process of its own (Python shows a
        # warning once per place and text, and the faults share gradstat's warning)
        stderr = args.out / f"{fault}-stderr-rank{dist.get_rank()}.txt"
        with stderr_to(stderr), warnings.catch_warnings():
            warnings.simplefilter("default")
            train(fault, args.out / fault, args.steps)
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
