"""A user's own DDP training script with GradientCapture, run by the tests under torchrun.

Besides the capture it saves, for every recorded step, the all-reduced ``.grad`` that
DDP leaves on the parameters (``reference-rankN.npy``), so a test can check that the
mean of the learners' recorded gradients equals it, and (without gradient accumulation)
each learner's own local gradient computed apart from DDP (``local-rankN.npy``).

``--runs JSON`` (a list of argument lists, each as for one run) trains several runs one
after another in one launch, so a test module pays torchrun's start once.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from gradstat import GradientCapture
from gradstat.capture.worker import exit_without_teardown
from gradstat.capture.workloads import build_workload


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default=None, help="a JSON list of argument lists")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--workload", default="digits")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hook", default="allreduce", choices=["allreduce", "fp16", "powersgd"])
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--no-capture", action="store_true")
    parser.add_argument("--record-ranks", default=None)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if args.runs is None and args.out is None:
        parser.error("give --out or --runs")
    return args


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    workload = build_workload(args.workload, "tiny")
    ddp = DistributedDataParallel(workload.model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    hooks = {
        "allreduce": (None, None),
        "fp16": (default_hooks.fp16_compress_hook, None),
        "powersgd": (
            powerSGD_hook.powerSGD_hook,
            powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
        ),
    }
    hook, state = hooks[args.hook]
    if args.no_capture:
        capture = None
        if hook is not None:
            ddp.register_comm_hook(state, hook)
    else:
        capture = GradientCapture(
            ddp,
            args.out,
            hook=hook,
            hook_state=state,
            meta={"workload": "test"},
            batch_size=16 * args.accumulate,  # what each learner's step averages over
            record_ranks=args.record_ranks,
            dtype=args.dtype,
        )
    batches = workload.batches(rank, dist.get_world_size(), 16, 0)
    reference, local = [], []
    params = list(ddp.module.parameters())
    for step in range(args.steps):
        optimizer.zero_grad()
        for micro in range(args.accumulate):
            inputs, targets = next(batches)
            if args.accumulate == 1:  # the plain module: no DDP hook, no .grad
                own = torch.autograd.grad(workload.loss(ddp.module(inputs), targets), params)
                local.append(torch.cat([g.reshape(-1) for g in own]).numpy().copy())
            if micro < args.accumulate - 1:
                with ddp.no_sync():
                    workload.loss(ddp(inputs), targets).backward()
            else:
                loss = workload.loss(ddp(inputs), targets)
                loss.backward()
        reference.append(
            torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).numpy().copy()
        )
        optimizer.step()
        if capture is not None:
            capture.step(step, loss.item())
    if capture is not None:
        capture.close()
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / f"reference-rank{rank}.npy", np.stack(reference))
    if local:
        np.save(args.out / f"local-rank{rank}.npy", np.stack(local))
    weights = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).numpy()
    np.save(args.out / f"weights-rank{rank}.npy", weights)


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    for run in [args] if args.runs is None else [parse(a) for a in json.loads(args.runs)]:
        train(run)
    dist.destroy_process_group()
    exit_without_teardown()  # gloo may abort in static destructors at exit


if __name__ == "__main__":
    main()
