"""FSDP2 training with a compressor inside each unit's reduce-scatter, run by
tests/test_fsdp_compression.py: for each run in ``--runs`` (``dense``, or a compressor
spec) a small model with ``fully_shard`` units trains a few steps on the gloo learners
(``--hsdp``: HSDP on a ``(2, world / 2)`` mesh; a compressor's runs shard on its
``shard`` dim alone and the hook compresses the replicate stage too, ``replicate=2``)
under a ``GradientCapture`` with gradstat's compression hook (``granularity="unit"``).
``<out>/<run>/applied-rankN.npy`` holds the gradient each step applied (steps x numel,
every parameter's full gradient gathered from the shards, in ``named_parameters()``
order), for the test to compare with the replay's estimate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradstat import GradientCapture
from gradstat.capture.worker import exit_without_teardown
from gradstat.hooks import compression_hook

STEPS, RATIO = 3, 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block1 = nn.Linear(9, 15)
        self.block2 = nn.Linear(15, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block2(torch.tanh(self.block1(x)))))


def folder(run: str) -> str:
    return "".join("_" if c in ":+=" else c for c in run)


def run(spec: str, out: Path, hsdp: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    replicate = 2 if hsdp else 1
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if spec != "dense":  # gradstat runs the replicate stage, compressed
            mesh = mesh["shard"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    for name in ("block1", "block2"):
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = None
    if spec != "dense":
        ratio = RATIO if spec.startswith("topk") else None
        _, state = compression_hook(spec, ratio=ratio, granularity="unit", replicate=replicate)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = []
    with GradientCapture(model, out / folder(spec), hook_state=state) as capture:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(5, 9, generator=g), torch.randn(5, 3, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            grads = [p.grad.full_tensor().reshape(-1) for p in model.parameters()]
            applied.append(torch.cat(grads).numpy())
            optimizer.step()
            capture.step(step, loss.item())
    np.save(out / folder(spec) / f"applied-rank{rank}.npy", np.stack(applied))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", required=True)
    parser.add_argument("--hsdp", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for spec in args.runs.split(","):
        run(spec, args.out, args.hsdp)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
