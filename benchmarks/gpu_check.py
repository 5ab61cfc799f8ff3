"""The GPU check's Python parts, driven by ``benchmarks/gpu_check.sh``.

``train`` (under torchrun): a built-in workload on CUDA (or CPU) with GradientCapture;
each rank saves the all-reduced ``.grad`` of every step (``reference-rankN.npy``); with
``--fsdp`` the model is sharded with FSDP2 (``fully_shard`` per block) and the reference
is the reduced gradient gathered from the shards.
``verify DIR``: the mean of the learners' recorded rows must equal that ``.grad``.
``overhead`` (under torchrun): training step time with capture at every=1 and every=10
divided by the same training without capture, in one process, variants interleaved in
rotating blocks (median per variant) so that noise hits them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _setup(args: argparse.Namespace):
    import torch
    import torch.distributed as dist

    dist.init_process_group(args.backend)
    if args.device == "cuda":
        # nccl: one GPU per rank; gloo: every rank shares GPU 0 (CUDA tensors over gloo)
        index = int(os.environ.get("LOCAL_RANK", 0)) if args.backend == "nccl" else 0
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return device


def _wrap(model, device, args: argparse.Namespace):
    """DDP, or with ``--fsdp`` FSDP2 as ``gradstat capture --fsdp`` shards it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = model.to(device)
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        from gradstat.capture.workloads import fully_shard_workload

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return fully_shard_workload(args.workload, model, mesh)
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def _reduced_gradient(model, args: argparse.Namespace):
    """The gradient the optimizer sees, flat, in parameter order (FSDP: gathered)."""
    import torch

    params = model.parameters() if args.fsdp else model.module.parameters()
    grads = [p.grad.full_tensor() if args.fsdp else p.grad for p in params if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in grads]).float().cpu().numpy()


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from gradstat import GradientCapture
    from gradstat.capture.worker import exit_without_teardown
    from gradstat.capture.workloads import build_workload

    device = _setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    workload = build_workload(args.workload, args.size)
    ddp = _wrap(workload.model, device, args)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    capture = GradientCapture(ddp, args.out, meta={"workload": args.workload, "check": "gpu"})
    batches = workload.batches(rank, world, args.batch_size, 0)
    reference = []
    for step in range(args.steps):
        inputs, targets = next(batches)
        loss = workload.loss(
            ddp(inputs.to(device, non_blocking=True)), targets.to(device, non_blocking=True)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reference.append(_reduced_gradient(ddp, args))
        optimizer.step()
        capture.step(step, loss.item())
    capture.close()
    np.save(Path(args.out) / f"reference-rank{rank}.npy", np.stack(reference))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()


def verify(args: argparse.Namespace) -> None:
    from gradstat import open_capture

    out = Path(args.out)
    reference = np.load(out / "reference-rank0.npy")
    with open_capture(out) as cap:
        if cap.status != "complete" or len(cap.steps) != len(reference):
            sys.exit(f"FAIL {out}: status {cap.status}, {len(cap.steps)} rows")
        worst = 0.0
        for row, (_step, grads) in enumerate(cap.iter_steps()):
            mean = grads.double().mean(0).numpy()
            scale = np.abs(reference[row]).max()
            worst = max(worst, float(np.abs(mean - reference[row]).max() / scale))
        learners = len(cap.learners)
    verdict = "PASS" if worst < args.tolerance else "FAIL"
    print(
        f"{verdict} {out.name}: {learners} learners x {len(reference)} steps x "
        f"{reference.shape[1]:,} values; max |mean(rows) - .grad| / max|.grad| = {worst:.1e}"
    )
    if verdict == "FAIL":
        sys.exit(1)


def overhead(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from gradstat import GradientCapture
    from gradstat.capture.worker import exit_without_teardown
    from gradstat.capture.workloads import build_workload

    device = _setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = build_workload(args.workload, args.size)
    variants = {}
    for name in ("none", "every=1", "every=10"):
        torch.manual_seed(0)
        ddp = _wrap(build_workload(args.workload, args.size).model, device, args)
        capture = None
        if name != "none":
            every = int(name.split("=")[1])
            capture = GradientCapture(ddp, Path(args.out) / name.replace("=", ""), every=every)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        variants[name] = (ddp, optimizer, capture, [])
    batches = workload.batches(rank, world, args.batch_size, 0)
    batch = [t.to(device) for t in next(batches)]  # one batch: time the step, not the data
    for block in range(args.blocks + 1):  # block 0 warms up
        for ddp, optimizer, capture, times in variants.values():
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            for step in range(args.steps):
                loss = workload.loss(ddp(batch[0]), batch[1])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if capture is not None:
                    capture.step(step)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if block > 0:
                times.append((time.perf_counter() - started) / args.steps)
    medians = {name: statistics.median(v[3]) for name, v in variants.items()}
    for _, _, capture, _ in variants.values():
        if capture is not None:
            capture.close()
    if rank == 0:
        base = medians["none"]
        numel = sum(p.numel() for p in variants["none"][0].parameters())
        mode = "FSDP2" if args.fsdp else "DDP"
        print(
            f"overhead {args.workload} ({numel:,} parameters, {mode}, {world} rank(s), "
            f"{args.backend}, "
            f"{device.type}, batch {args.batch_size}): step time / without capture = "
            f"{medians['every=1'] / base:.2f} at every=1, {medians['every=10'] / base:.2f} at "
            f"every=10 (median of {args.blocks} blocks of {args.steps} steps; without capture "
            f"{base * 1e3:.1f} ms/step)"
        )
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("train", "overhead"):
        sub = commands.add_parser(name)
        sub.add_argument("--out", required=True)
        sub.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
        sub.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        sub.add_argument("--workload", default="resnet50")
        sub.add_argument("--size", default=None)
        sub.add_argument("--batch-size", type=int, default=32)
        sub.add_argument("--steps", type=int, default=3)
        sub.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
        if name == "overhead":
            sub.add_argument("--blocks", type=int, default=5)
    check = commands.add_parser("verify")
    check.add_argument("out")
    check.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    {"train": train, "verify": verify, "overhead": overhead}[args.command](args)


if __name__ == "__main__":
    main()
