"""A user's FSDP2 training script with GradientCapture, run by tests/test_fsdp.py.

For each case named in ``--cases`` it trains a small model with ``fully_shard`` (nested
units of uneven sizes, an embedding, a parameter smaller than the world) for a few
steps under a capture, and beside it an unsharded replica: before every step the
replica takes the FSDP model's full parameters, runs this rank's same micro-batches and
keeps its local gradient. ``<out>/<case>/ref-rankN.npy`` holds those gradients (steps x
numel, in ``named_parameters()`` order, rounded as the case records them), for the test
to compare with the capture in ``<out>/<case>``.
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from gradstat import GradientCapture
from gradstat.capture.worker import exit_without_teardown
from gradstat.errors import UsageError

VOCAB, WIDTH, HIDDEN, OUT = 37, 6, 13, 12
STEPS, BATCH, LENGTH = 2, 3, 4


class Net(nn.Module):
    """Embedding -> two nested units -> a residual extra -> norm -> head; dim-0 sizes
    uneven for 2, 3 and 4."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.block1 = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh())
        self.block2 = nn.Linear(HIDDEN, OUT)
        self.extra = nn.Linear(OUT, OUT)  # skipped while use_extra is unset
        self.use_extra = True
        self.norm = nn.LayerNorm(OUT)
        self.gain = nn.Parameter(torch.ones(2))  # fewer rows than learners
        self.head = nn.Linear(OUT, VOCAB)
        self.spare = nn.Parameter(torch.ones(3))  # used only while use_spare is set
        self.use_spare = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.emb(tokens)))
        if self.use_extra:
            x = x + self.extra(x)
        x = self.norm(x)
        x = x * self.gain.sum()
        if self.use_spare:
            x = x * self.spare.mean()
        return self.head(x)


# case -> settings: micro-batches per step, MixedPrecisionPolicy reduce dtype, storage
# dtype, the capture's record_ranks and layers, a 2-D (HSDP) mesh, Shard(1) placements,
# the units fully_shard is applied to before the root (a tuple: one unit over several)
UNITS = ("block1", "block2")
CASES = {
    "plain": {},
    "accumulate": {"micro": 3},
    "bf16-reduce": {"reduce": torch.bfloat16},
    "fp16-reduce": {"reduce": torch.float16},
    "bf16-store": {"dtype": "bfloat16", "record_ranks": "0", "layers": "block|emb"},
    "shard-dim1": {"dim1": True},
    "hsdp": {"hsdp": True, "micro": 2},
    # accumulation without set_requires_gradient_sync(False): every micro-batch is
    # reduce-scattered, the row restarts and holds the last one (and a warning says so)
    "always-sync": {"micro": 2, "always_sync": True},
    # step 0 leaves a root parameter without gradient: FSDP reduce-scatters the others
    # only, the step is not recorded (a warning says so); step 1 is
    "unused": {"unused": True},
    # ... unless FSDP reduce-scatters unused parameters as zeros: then step 0 is recorded
    "unused-zeros": {"unused": True, "scatter_unused": True},
    # HSDP whose shard dim has one learner: never reduce-scattered, refused in one line
    "replicate-only": {"replicate_only": True},
    # frozen parameters inside units (LoRA, frozen embeddings): FSDP leaves them out of
    # the reduce-scatter input; a unit whose parameters are all frozen never reduces
    "frozen": {"frozen": ("emb.weight", "block1.0.bias", "block2.weight", "block2.bias")},
    # torchtitan's layout: one fully_shard over the final norm and the output head
    "grouped": {"units": (*UNITS, ("norm", "head"))},
    # a unit the forward skips on step 1: recorded as zeros, with one warning
    "skipped": {"units": (*UNITS, "extra"), "skip_extra": True},
    # a float16 param_dtype without reduce_dtype: the reduction runs in float16 and
    # FSDP divides the input before it (gradstat multiplies it back)
    "fp16-params": {"param": torch.float16},
}


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def _grad(param: torch.Tensor) -> torch.Tensor:
    if param.grad is None:
        return torch.zeros(param.numel())
    return param.grad.float().reshape(-1)


def run_case(name: str, out: Path) -> None:
    settings = CASES[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = settings.get("micro", 1)
    torch.manual_seed(0)
    model = Net()
    for param_name in settings.get("frozen", ()):
        model.get_parameter(param_name).requires_grad_(False)
    replica = copy.deepcopy(model)
    if "param" in settings:  # the replica computes in FSDP's param_dtype
        replica.to(settings["param"])
    if settings.get("hsdp") or settings.get("replicate_only"):
        shape = (world, 1) if settings.get("replicate_only") else (2, world // 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    options: dict = {"mesh": mesh}
    if "reduce" in settings or "param" in settings:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=settings.get("param"), reduce_dtype=settings.get("reduce")
        )
    if settings.get("dim1"):

        def dim1(p: torch.Tensor) -> Shard | None:  # where dim 1 splits evenly (6 and 12)
            return Shard(1) if p.ndim == 2 and p.shape[1] % world == 0 else None

        options["shard_placement_fn"] = dim1
    for unit in settings.get("units", UNITS):
        names = unit if isinstance(unit, tuple) else (unit,)
        modules = [model.get_submodule(n) for n in names]
        fully_shard(modules if isinstance(unit, tuple) else modules[0], **options)
    fully_shard(model, **options)
    if settings.get("scatter_unused"):
        model.set_reduce_scatter_unused_params(True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    dtype = settings.get("dtype")
    try:
        capture = GradientCapture(
            model,
            out / name,
            dtype=dtype,
            record_ranks=settings.get("record_ranks"),
            layers=settings.get("layers"),
        )
    except UsageError as exc:  # what the case expects: saved for the test
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / f"error-rank{rank}.txt").write_text(str(exc))
        return
    names = [layer.name for layer in capture.layers]
    references = []
    for step in range(STEPS):
        if settings.get("unused"):
            model.use_spare = replica.use_spare = step > 0
        if settings.get("skip_extra"):
            model.use_extra = replica.use_extra = step != 1
        with torch.no_grad():  # the replica takes the FSDP model's parameters (collective)
            full = {n: p.full_tensor() for n, p in model.named_parameters()}
            for n, p in replica.named_parameters():
                p.copy_(full[n])
        replica.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        for m in range(micro):
            tokens, targets = batch(rank, step, m)
            last = m == micro - 1
            model.set_requires_gradient_sync(last or settings.get("always_sync", False))
            if settings.get("always_sync"):
                replica.zero_grad(set_to_none=True)
            loss = loss_of(model, tokens, targets)
            loss.backward()
            loss_of(replica, tokens, targets).backward()
        optimizer.step()
        capture.step(step, loss.item())
        grads = dict(replica.named_parameters())
        row = torch.cat([_grad(grads[n]) for n in names])
        if "reduce" in settings:  # FSDP reduces in that dtype: the input is rounded to it
            row = row.to(settings["reduce"]).float()
        if dtype == "bfloat16":
            row = row.to(torch.bfloat16).float()
        dropped = settings.get("unused") and not settings.get("scatter_unused") and step == 0
        if not dropped:
            references.append(row.numpy())
    capture.close()
    np.save(out / name / f"ref-rank{rank}.npy", np.stack(references))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo")
    for name in args.cases.split(","):
        run_case(name, args.out)
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
