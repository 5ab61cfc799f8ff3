"""Training with a framework and gradstat's integration, run by the tests under torchrun.

``--framework lightning|transformers|accelerate`` trains a tiny regression MLP on each
learner's own shard for 3 optimizer steps of 2 accumulated micro-batches
(``lightning-fsdp2``: Lightning's ModelParallelStrategy with FSDP2, 3 steps), with gradstat
recording, and saves the all-reduced ``.grad`` the optimizer sees at each step
(``reference-rankN.npy``) so a test can check that the mean of the recorded local
gradients equals it.
"""

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradstat.capture.worker import exit_without_teardown

STEPS, ACCUMULATE, BATCH = 3, 2, 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def _flat_grad(model: nn.Module) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()


def _train_with_lightning(out: Path, label: str, strategy, shard: bool) -> list[np.ndarray]:
    """Lightning's Trainer on 2 CPU devices with ``strategy``; ``shard``: the module
    shards itself with ``fully_shard`` in ``configure_model`` (ModelParallelStrategy),
    which reduce-scatters every micro-batch, so no accumulation then."""
    import lightning.pytorch as pl

    from gradstat.integrations.lightning import GradstatCallback

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def configure_model(self) -> None:
            if shard:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                fully_shard(self.net[0], mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Reference(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[np.ndarray] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad.full_tensor() if shard else p.grad for p in pl_module.parameters()]
            self.rows.append(torch.cat([g.reshape(-1) for g in grads]).numpy().copy())

    reference = Reference()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=1 if shard else ACCUMULATE,
        callbacks=[GradstatCallback(out, meta={"test": label}), reference],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(_data(), batch_size=BATCH))
    return reference.rows


def train_lightning(out: Path) -> list[np.ndarray]:
    return _train_with_lightning(out, "lightning", "ddp", shard=False)


def train_transformers(out: Path) -> list[np.ndarray]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradstat.integrations.transformers import attach

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x, labels):
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    class Reference(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[np.ndarray] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.rows.append(_flat_grad(model))

    data = _data()
    examples = [{"x": x, "labels": y} for x, y in zip(*data.tensors, strict=True)]
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=0.1,
        max_grad_norm=0.0,  # clipping would change .grad after the all-reduce
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    reference = Reference()
    trainer = Trainer(model=Regression(), args=args, train_dataset=examples, callbacks=[reference])
    attach(trainer, out, meta={"test": "transformers"})
    trainer.train()
    return reference.rows


def train_accelerate(out: Path) -> list[np.ndarray]:
    from accelerate import Accelerator

    from gradstat import GradientCapture

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    capture = GradientCapture(model, out)  # the documented pattern, line 1
    rows, step = [], 0
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                rows.append(_flat_grad(model.module))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:  # line 2
            capture.step(step, loss.item())  # line 3
            step += 1
            if step == STEPS:
                break
    capture.close()
    return rows


def train_lightning_fsdp2(out: Path) -> list[np.ndarray]:
    """Lightning's ModelParallelStrategy with FSDP2; the callback records the sharded
    model."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return _train_with_lightning(out, "lightning-fsdp2", strategy, shard=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--framework",
        required=True,
        choices=["lightning", "transformers", "accelerate", "lightning-fsdp2"],
    )
    args = parser.parse_args()
    train = {
        "lightning": train_lightning,
        "transformers": train_transformers,
        "accelerate": train_accelerate,
        "lightning-fsdp2": train_lightning_fsdp2,
    }[args.framework]
    rows = train(args.out)
    np.save(args.out / f"reference-rank{dist.get_rank()}.npy", np.stack(rows))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown()  # gloo may abort in static destructors at exit


if __name__ == "__main__":
    main()
