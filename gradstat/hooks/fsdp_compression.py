"""Every compressor and number format inside FSDP2's reduce-scatter (issue 37;
docs/capture.md, "Training with a compressor under FSDP2").

:func:`install` gives each ``fully_shard`` unit a custom reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``, public API) that replaces FSDP's own: the
unit's reduce-scatter input (the ``(world_size, -1)`` chunks of its padded gradients,
:class:`~gradstat.capture.fsdp.UnitLayout`) is laid back into the learner's flat row,
each message of the ``unit`` plan it holds (the unit's trainable parameters, in its
order, as one flat message; ``--dense`` parameters as one more) goes through the
compression hook's own step (:meth:`~gradstat.hooks.compression.CompressionState.run_unit`:
the memory's compensate and update, per learner and unit; the compressor's exchange over
real gloo collectives), and the learner keeps its shard of the decoded mean, in FSDP's
layout and units (the sum FSDP divides afterwards when it reduces by ``SUM``). A
sparsifier all-gathers its payloads here (it has no reduce-scatter form); a number
format all-gathers the float32 messages and runs the emulated reduce-scatter locally
(:mod:`gradstat.compressors.cast`), bit for bit the replay's at ``--granularity unit``.

Not supported (a ``UsageError`` before training): HSDP (a replicate dim: its all-reduce
would sum the replicas' means again), units of one learner (no reduce-scatter), a
``gradient_divide_factor`` that makes FSDP reduce by ``PREMUL_SUM`` (an error at the
first reduce-scatter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradstat.capture.fsdp import ReduceScatter, UnitLayout
from gradstat.errors import UsageError

if TYPE_CHECKING:
    from gradstat.hooks.compression import CompressionState


class CompressedReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """One unit's reduce-scatter through the compression hook's state."""

    def __init__(self, state: CompressionState, layout: UnitLayout, messages: list[int]) -> None:
        self.state, self.layout, self.messages = state, layout, messages

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        world, rank = group.size(), group.rank()
        if op == dist.ReduceOp.SUM:
            factor = float(world)
        elif op == dist.ReduceOp.AVG:
            factor = 1.0
        else:
            raise UsageError(
                f"FSDP unit {self.layout.name} reduces with {op}: a compressor under FSDP2 "
                "needs FSDP's default reduction (no gradient_divide_factor)"
            )
        flat = input_tensor.detach().to("cpu", torch.float32)
        mean = self.state.run_unit(self.layout, self.messages, flat, world)
        # the mean in the input's units (FSDP may have divided it), summed where FSDP sums
        shard = self.layout.shard_of(mean, world, rank) * (factor / self.layout.scale)
        output_tensor.copy_(shard.to(output_tensor.device, output_tensor.dtype))
        return None


def install(state: CompressionState, layouts: list[tuple[torch.nn.Module, UnitLayout]]) -> None:
    """Give every unit of ``layouts`` its compressed reduce-scatter (see the module
    docstring); the state's plan must be the ``unit`` plan of these units."""
    for _, layout in layouts:  # every refusal before any unit is touched
        if layout.replicate > 1:
            raise UsageError(
                f"FSDP unit {layout.name} is replicated over {layout.replicate} learners "
                "(HSDP): gradstat trains with a compressor under FSDP2 without replication"
            )
        if layout.shard < 2:
            raise UsageError(
                f"FSDP unit {layout.name} is sharded over one learner: nothing to compress"
            )
    plan = state.plan
    for unit, layout in layouts:
        messages = [
            m for m, message in enumerate(plan.messages)
            if message.name.removesuffix(" (dense)") == layout.name
        ]  # fmt: skip
        if messages:
            unit.set_custom_reduce_scatter(CompressedReduceScatter(state, layout, messages))
