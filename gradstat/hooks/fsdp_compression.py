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

HSDP, both stages compressed (``compression_hook(..., replicate=R)``, ``capture --fsdp
--hsdp R --compressor``): the model is ``fully_shard``-ed on its shard group alone (a
1-D mesh, ``mesh["shard"]`` of a ``(replicate, shard)`` mesh: shard groups of S
consecutive ranks), so FSDP runs no all-reduce; the compressor runs in the
reduce-scatter within the shard group (stage 1, as below), then each unit's all-reduce
hook (``FSDPModule.set_all_reduce_hook``, public: it receives the reduced shard, the
group's mean, and what it leaves there lands in ``.grad``) runs stage 2
(:class:`ReplicateStage`): the shard goes through the compressor again over the
learner's replicate group (the R learners holding the same shard index, one per shard
group; a gloo group made here on every learner), with a memory per learner of its own,
and the decoded mean over the R replaces it. ``/sent`` records stage 1's contribution;
the bytes are both stages'. The units record ``replicate`` R and
``replicate_compressed`` (:func:`mark_replicated`), and the replay models both stages
(:attr:`~gradstat.compressors.plan.Message.replicate_compressed`). Refused there: a
reduce dtype other than float32, a parameter sharded on a dim other than 0, ``--dense``.

HSDP on the user's own ``(replicate, shard)`` mesh: the compressor runs in the
reduce-scatter, within the learner's shard group (a gloo group of its own over the same
ranks, made here on every learner), with error feedback per learner as without
replication; FSDP's replicate all-reduce then averages the reduced shards densely, in
the reduce dtype (torch 2.13 has no public seam to replace that all-reduce:
``set_all_reduce_hook`` runs after it; ``set_requires_all_reduce(False)`` defers it,
keeping the reduced shard for the next backward and leaving ``.grad`` unset). The
replay's ``unit`` plan models the same
(:attr:`~gradstat.compressors.plan.Message.replicate`). Either way the shard groups must
be consecutive ranks (``init_device_mesh``'s layout), as the replay numbers them.

Not supported (a ``UsageError`` before training): units of one learner (no
reduce-scatter), units on different meshes under HSDP, shard groups of other than
consecutive ranks, a ``gradient_divide_factor`` that makes FSDP reduce by
``PREMUL_SUM`` (an error at the first reduce-scatter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradstat.capture.fsdp import ReduceScatter, UnitLayout, shard_groups
from gradstat.errors import UsageError

if TYPE_CHECKING:
    from gradstat.hooks.compression import CompressionState


class CompressedReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """One unit's reduce-scatter through the compression hook's state (over ``group``,
    the learner's shard group under HSDP; None: the state's group of every learner)."""

    def __init__(
        self,
        state: CompressionState,
        layout: UnitLayout,
        messages: list[int],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.state, self.layout, self.messages, self.group = state, layout, messages, group

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
        if self.group is not None and (
            dist.get_process_group_ranks(group) != dist.get_process_group_ranks(self.group)
        ):
            raise UsageError(
                f"FSDP unit {self.layout.name} reduce-scatters over ranks "
                f"{dist.get_process_group_ranks(group)}, not its mesh's shard group"
            )
        flat = input_tensor.detach().to("cpu", torch.float32)
        mean = self.state.run_unit(self.layout, self.messages, flat, world, self.group)
        # the mean in the input's units (FSDP may have divided it), summed where FSDP sums
        shard = self.layout.shard_of(mean, world, rank) * (factor / self.layout.scale)
        output_tensor.copy_(shard.to(output_tensor.device, output_tensor.dtype))
        return None


class ReplicateStage:
    """One unit's all-reduce hook under HSDP with both stages compressed: its reduced
    shard (the shard group's mean of message ``m``) through the compression hook's
    replicate stage over ``group``, replaced in place by the mean over the replicas."""

    def __init__(self, state: CompressionState, layout: UnitLayout, m: int, group) -> None:
        self.state, self.layout, self.m, self.group = state, layout, m, group

    def __call__(self, output: torch.Tensor) -> None:
        shard = output.detach().to("cpu", torch.float32)
        mean = self.state.run_replicate(self.m, shard, self.layout.shard, self.group)
        output.copy_(mean.to(output.device, output.dtype))


def install(state: CompressionState, layouts: list[tuple[torch.nn.Module, UnitLayout]]) -> None:
    """Give every unit of ``layouts`` its compressed reduce-scatter, and under HSDP with
    both stages compressed its replicate stage (see the module docstring); the state's
    plan must be the ``unit`` plan of these units. Every learner calls it (under HSDP it
    makes the shard groups' gloo groups, and the replicate groups')."""
    for _, layout in layouts:  # every refusal before any unit is touched
        if layout.shard < 2:
            raise UsageError(
                f"FSDP unit {layout.name} is sharded over one learner: nothing to compress"
            )
    if state.replicate > 1:
        group, replicas = replicate_groups(layouts, state.world, state.replicate)
    else:
        group, replicas = hsdp_group(layouts, state.world), None
    plan = state.plan
    for unit, layout in layouts:
        messages = [
            m for m, message in enumerate(plan.messages)
            if message.name.removesuffix(" (dense)") == layout.name
        ]  # fmt: skip
        if messages:
            unit.set_custom_reduce_scatter(CompressedReduceScatter(state, layout, messages, group))
            if replicas is not None:  # one message a unit: --dense is refused there
                unit.set_all_reduce_hook(ReplicateStage(state, layout, messages[0], replicas))


def mark_replicated(layouts: list[tuple[torch.nn.Module, UnitLayout]], replicate: int) -> None:
    """Units sharded on one shard group whose replicate stage gradstat runs over
    ``replicate`` shard groups (``compression_hook(..., replicate=R)``): their layouts
    say so, before the capture records them. Refused: a unit on a 2-D mesh (FSDP would
    run its own all-reduce too), a reduce dtype other than float32 (FSDP divides after
    the hook in float16; a bf16 shard would round between the stages), a parameter
    sharded on a dim other than 0."""
    for _, layout in layouts:
        if layout.replicate != 1:
            raise UsageError(
                f"FSDP unit {layout.name} is on a (replicate, shard) mesh: with a compressed "
                'replicate stage shard it on the shard group alone (mesh["shard"])'
            )
        if layout.wire != torch.float32:
            raise UsageError(
                f"FSDP unit {layout.name} reduces in {layout.wire}: a compressed replicate "
                "stage needs reduce_dtype float32"
            )
        if any(slot.shard_dim != 0 for slot in layout.slots):
            raise UsageError(
                f"FSDP unit {layout.name} shards a parameter on a dim other than 0: a "
                "compressed replicate stage needs FSDP's default Shard(0)"
            )
        layout.replicate, layout.replicate_compressed = replicate, True


def replicate_groups(
    layouts: list[tuple[torch.nn.Module, UnitLayout]], world: int, replicate: int
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This learner's gloo groups for HSDP with both stages compressed (made on every
    learner): its shard group (S consecutive ranks) and its replicate group (the R
    ranks with its shard index). Refused on every learner alike (each one's shard groups
    gathered first): shard groups that are not consecutive ranks covering the ``world``
    learners in ``replicate`` groups."""
    shards = {layout.shard for _, layout in layouts}
    (shard,) = shards if len(shards) == 1 else (0,)
    seen = {str(shard_groups(layout.slots[0].param)) for _, layout in layouts}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, sorted(seen))
    consecutive = [list(range(g * shard, (g + 1) * shard)) for g in range(replicate)]
    expected = [[str([ranks])] for ranks in consecutive for _ in ranks]
    if shard * replicate != world or everyone != expected:
        raise UsageError(
            f"FSDP units sharded over {sorted(shards)} learners of {world} with "
            f"replicate={replicate}: a compressed replicate stage needs every unit on the "
            "shard group of consecutive ranks (init_device_mesh(..., (replicate, shard))"
            '["shard"]), replicate x shard = every learner'
        )
    strided = [list(range(s, world, shard)) for s in range(shard)]
    group, _ = dist.new_subgroups_by_enumeration(consecutive, backend="gloo")
    replicas, _ = dist.new_subgroups_by_enumeration(strided, backend="gloo")
    return group, replicas


def hsdp_group(
    layouts: list[tuple[torch.nn.Module, UnitLayout]], world: int
) -> dist.ProcessGroup | None:
    """Under HSDP, a gloo group of this learner's shard group (made on every learner,
    one per shard group); None without replication. Refused: units on different
    meshes, shard groups that are not consecutive ranks (the replay's numbering) or
    that do not tile the ``world`` learners."""
    if all(layout.replicate == 1 for _, layout in layouts):
        return None
    meshes = {(layout.shard, layout.replicate) for _, layout in layouts}
    groups = {str(shard_groups(layout.slots[0].param)) for _, layout in layouts}
    if len(meshes) > 1 or len(groups) > 1:
        raise UsageError(
            "FSDP units are on different meshes under HSDP: a compressor under FSDP2 needs "
            "every unit on the same (replicate, shard) mesh"
        )
    ((shard, replicate),) = meshes
    ranks = shard_groups(layouts[0][1].slots[0].param)
    consecutive = [list(range(g * shard, (g + 1) * shard)) for g in range(replicate)]
    if ranks != consecutive or shard * replicate != world:
        raise UsageError(
            f"HSDP shard groups {ranks} of {world} learners: a compressor under FSDP2 needs "
            "shard groups of consecutive ranks covering every learner (init_device_mesh("
            "..., (replicate, shard)) makes them), as the replay numbers them"
        )
    mine, _ = dist.new_subgroups_by_enumeration(ranks, backend="gloo")
    return mine
