"""Record the buckets DDP hands its communication hook (tests/test_plan.py): two gloo
learners train small models for 3 iterations with a hook that notes each bucket's
parameters (``GradBucket.parameters()``, by name) and then all-reduces as DDP would; rank
0 writes ``OUT`` as JSON: per case, the layer table and the buckets of every iteration."""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gradstat.capture.worker import exit_without_teardown


def mlp() -> torch.nn.Module:
    """Linear layers (their bias's gradient is ready before their weight's: reverse
    registration order) of 3 KiB to 1.3 MB: 1 MiB's first bucket closes inside."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, 640),
        torch.nn.ReLU(),
        torch.nn.Linear(640, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


CASES = {  # name: (model, input shape, DDP's bucket_cap_mb or None for its default)
    "default": (mlp, (8, 64), None),
    "0.5": (mlp, (8, 64), 0.5),
    "0.01": (mlp, (8, 64), 0.01),
}


def record(case: str) -> dict:
    make, shape, cap = CASES[case]
    torch.manual_seed(0)
    model = make()
    names = {id(p): n for n, p in model.named_parameters()}
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    ddp = DistributedDataParallel(model, **kwargs)
    seen: list[list[list[str]]] = []

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() == 0:
            seen.append([])
        seen[-1].append([names[id(p)] for p in bucket.parameters()])
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(3):
        loss = ddp(torch.randn(*shape)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    layers = [(n, list(p.shape)) for n, p in model.named_parameters()]
    return {"cap": cap, "layers": layers, "iterations": seen}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    found = {case: record(case) for case in CASES}
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(found))
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
