"""FSDP2 (``fully_shard``): where the capture finds each learner's local gradient.

Under FSDP2 a learner's full local gradient exists only until its unit's
reduce-scatter. Each FSDP unit (the root and every nested ``fully_shard`` module) gets
a custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``, public API) that
hands the unit's reduce-scatter input to the capture and then runs the reduce-scatter
the user had set (default: FSDP's own). That input is the ``(world_size, -1)``
``chunk_cat`` of the unit's unsharded local gradients, in the unit's parameter order:
each gradient padded on dim 0 to a multiple of ``world_size`` and cut into
``world_size`` chunks (a gradient sharded on dim k > 0 is first cut on dim k and the
pieces stacked on dim 0, so it needs no padding). :class:`UnitLayout` knows where each
parameter's chunks sit and copies them into the flat row (docs/capture.md, "FSDP").

With a reduce-scatter group of one learner FSDP skips the reduce-scatter and copies the
input to the output; the capture then reads that output in the unit's all-reduce hook
(``FSDPModule.set_all_reduce_hook``), which runs right after.

Which parameters a unit holds, in which order, and the comm and hook a user set, FSDP
keeps in its unit state (``_get_fsdp_state()._fsdp_param_groups``); this module is the
one place that reads it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradstat.errors import UsageError
from gradstat.wire import shards

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

try:  # FSDP2 (public API)
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - torch without custom comms
    ReduceScatter = object  # type: ignore[assignment,misc]


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (root first)."""
    if FSDPModule is None:
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def check_fsdp_support(module_class: type | None = FSDPModule) -> None:
    """One clear error where this torch cannot install a custom reduce-scatter
    (``module_class``: this torch's ``FSDPModule``, None without FSDP2)."""
    if module_class is None or not hasattr(module_class, "set_custom_reduce_scatter"):
        raise UsageError(
            f"capture under FSDP2 needs torch >= 2.11 (FSDPModule.set_custom_reduce_scatter); "
            f"this is torch {torch.__version__}"
        )


def _param_group(unit: nn.Module):
    """The unit's one FSDP parameter group (None when it manages no parameter)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per unit
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    if len(groups) > 1:
        raise UsageError(
            f"FSDP unit {type(unit).__name__} has {len(groups)} parameter groups "
            "(a shard_placement_fn that puts parameters on different meshes); gradstat "
            "records one mesh per unit: return the same mesh for every parameter"
        )
    return groups[0] if groups else None


@dataclass(frozen=True)
class ParamSlot:
    """One parameter of a unit: its shape, the dim FSDP shards it on, and where its
    gradient goes in the capture row (``offset .. offset + numel``; ``offset`` None when
    not recorded). ``param`` is the module's (sharded) parameter: FSDP puts a parameter's
    gradient into the reduce-scatter input only while it requires grad."""

    shape: tuple[int, ...]
    shard_dim: int
    offset: int | None
    param: torch.Tensor = field(compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def chunk(self, world_size: int) -> int:
        """Values of this parameter in one row of the ``(world_size, -1)`` input."""
        return shards.chunk(self.shape, self.shard_dim, world_size)


class UnitLayout:
    """Where one FSDP unit's parameters sit in its reduce-scatter input and in the row.

    ``name`` names the unit's modules (``norm+head`` for one ``fully_shard`` over
    several); ``shard`` and ``replicate`` are the learners of the unit's mesh that shard
    and that replicate it (HSDP: both > 1); ``wire`` is the dtype FSDP reduces in;
    ``scale`` undoes FSDP's division of the input before the reduce-scatter (1 unless
    the reduction runs in float16, see :func:`predivide_factor`);
    ``replicate_compressed``: gradstat runs the replicate stage itself, through the
    compressor (the unit is sharded on one shard group, ``replicate`` set by
    gradstat/hooks/fsdp_compression.py), not FSDP's dense all-reduce.
    """

    def __init__(
        self,
        name: str,
        slots: list[ParamSlot],
        shard: int,
        replicate: int,
        scale: float,
        wire: torch.dtype,
    ) -> None:
        self.name = name
        self.slots = slots
        self.shard, self.replicate, self.scale, self.wire = shard, replicate, scale, wire
        self.replicate_compressed = False

    @property
    def records(self) -> bool:
        """Whether any of the unit's parameters is recorded."""
        return any(slot.offset is not None for slot in self.slots)

    def _sent(self) -> list[ParamSlot]:
        """The parameters in the reduce-scatter input: those that require grad (FSDP
        leaves frozen ones out; ``slots`` keep the unit's parameter order)."""
        return [slot for slot in self.slots if slot.param.requires_grad]

    def input_numel(self, world_size: int) -> int:
        return world_size * sum(slot.chunk(world_size) for slot in self._sent())

    def zero_into(self, row: torch.Tensor) -> None:
        """Zeros in every recorded parameter's slice of ``row`` (a unit without gradient)."""
        for slot in self.slots:
            if slot.offset is not None:
                row[slot.offset : slot.offset + slot.numel].zero_()

    def copy_into(
        self, row: torch.Tensor, flat: torch.Tensor, world_size: int, non_blocking: bool
    ) -> bool:
        """Copy each recorded parameter's gradient from ``flat`` (the reduce-scatter input,
        1-D) into its slice of ``row``, undoing the padding, the chunking and FSDP's
        division; a recorded parameter frozen since the capture began gets zeros.

        False (nothing copied) when ``flat`` does not hold every parameter that requires
        grad: some got no gradient in this backward, and FSDP does not say which.
        """
        sent = self._sent()
        if flat.numel() != world_size * sum(slot.chunk(world_size) for slot in sent):
            return False
        if self.scale != 1.0:  # FSDP divided the input before the collective
            flat = flat.to(torch.float32) * self.scale
        shards.unshard(sent, flat.view(world_size, -1), row, non_blocking)
        for slot in self.slots:
            if slot.offset is not None and not slot.param.requires_grad:
                row[slot.offset : slot.offset + slot.numel].zero_()
        return True

    def shard_of(self, row: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
        """Learner ``rank``'s row of the ``(world_size, -1)`` reduce-scatter layout of
        the unit's values in ``row`` (the flat row, by the recorded offsets): what a
        reduce-scatter of that vector leaves on ``rank``; the inverse of
        :meth:`copy_into` (zeros in the padding, :func:`gradstat.wire.shards.shard_of`)."""
        return shards.shard_of(self._sent(), row, world_size, rank)


def unit_layouts(model: nn.Module, offsets: dict[int, int]) -> list[tuple[nn.Module, UnitLayout]]:
    """Each unit of ``model`` that manages parameters, with its layout; ``offsets`` maps
    ``id(param)`` of each recorded parameter to its offset in the row.

    One ``fully_shard([a, b])`` makes ``a`` and ``b`` FSDP modules with one shared
    parameter group: one unit, named ``a+b``, listed with its first module.
    """
    names = {id(module): name or "(root)" for name, module in model.named_modules()}
    groups: dict[int, tuple[nn.Module, Any, list[str]]] = {}
    for unit in fsdp_units(model):
        group = _param_group(unit)
        if group is not None and group.fsdp_params:
            groups.setdefault(id(group), (unit, group, []))[2].append(names[id(unit)])
    layouts = []
    for unit, group, unit_names in groups.values():
        name = "+".join(unit_names)
        params = [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]
        slots = [
            ParamSlot(tuple(p.shape), _shard_dim(p, name), offsets.get(id(p)), p) for p in params
        ]
        shard, replicate = shard_group_size(params[0])
        wire = wire_dtype(group, params[0].dtype)
        scale = predivide_factor(group, wire, shard * replicate)
        if shard == 1:  # no reduce-scatter: FSDP copies the input divided by its factor
            scale *= getattr(group, "gradient_divide_factor", None) or 1.0
        layouts.append((unit, UnitLayout(name, slots, shard, replicate, scale, wire)))
    return layouts


def units_meta(layouts: list[UnitLayout], layer_of: dict[int, int]) -> str:
    """The recording units as JSON for ``capture.h5`` (attribute ``fsdp_units``): for each,
    its ``name``, its recorded ``layers`` (indices in the layer table, in the unit's
    order; ``layer_of`` maps ``id(param)`` to them), its ``shard`` and ``replicate``
    learners, whether gradstat compressed the replicate stage (``replicate_compressed``)
    and its ``reduce_dtype``: FSDP's messages, for a replay that cuts rows as FSDP's
    reduce-scatter does."""
    units = [
        {
            "name": layout.name,
            "layers": [layer_of[id(s.param)] for s in layout.slots if s.offset is not None],
            "shard": layout.shard,
            "replicate": layout.replicate,
            "replicate_compressed": layout.replicate_compressed,
            "reduce_dtype": str(layout.wire).removeprefix("torch."),
        }
        for layout in layouts
        if layout.records
    ]
    return json.dumps(units)


def _shard_dim(param: torch.Tensor, unit: str) -> int:
    """The dim FSDP shards ``param`` on, from its DTensor placements (one ``Shard``)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = getattr(param, "placements", ())
    shards = [p for p in placements if isinstance(p, Shard)]
    others = [p for p in placements if not isinstance(p, Shard | Replicate)]
    if len(shards) != 1 or others or type(shards[0]) is not Shard:
        raise UsageError(
            f"FSDP unit {unit}: a parameter is placed {tuple(placements)}; gradstat records "
            "parameters that FSDP shards on one dim (no tensor parallelism)"
        )
    return shards[0].dim


def shard_group_size(param: torch.Tensor) -> tuple[int, int]:
    """``(shard learners, replicate learners)`` of a unit's DTensor parameter."""
    from torch.distributed.tensor import Shard

    mesh = param.device_mesh
    shard = replicate = 1
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            shard *= mesh.size(dim)
        else:
            replicate *= mesh.size(dim)
    return shard, replicate


def shard_groups(param: torch.Tensor) -> list[list[int]]:
    """The global ranks of every shard group of a unit's DTensor ``param`` (the learners
    of each replica that reduce-scatter together), from its device mesh's rank tensor
    (``DeviceMesh.mesh``): one list per replica, in mesh order."""
    from torch.distributed.tensor import Shard

    mesh = param.device_mesh
    dim = next(d for d, p in enumerate(param.placements) if isinstance(p, Shard))
    return mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist()


def predivide_factor(group: Any, reduce_dtype: torch.dtype, data_parallel: int) -> float:
    """The factor FSDP divides the reduce-scatter input by before the collective.

    Only reductions in dtypes other than float32 / bfloat16 (float16) divide before:
    by the largest power of two ``p`` with ``p * p < N`` that divides ``N`` (``N`` the
    gradient divide factor, default the data-parallel size), as torch's
    ``_get_gradient_divide_factors`` does; 1 otherwise.
    """
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0
    factor = getattr(group, "gradient_divide_factor", None) or float(data_parallel)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre)


def wire_dtype(group: Any, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype a unit's gradients are reduced in: the ``MixedPrecisionPolicy``'s
    ``reduce_dtype``, else its ``param_dtype`` (gradients are computed in it), else the
    parameters' own dtype."""
    policy = getattr(group, "mp_policy", None)
    return (
        getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None) or param_dtype
    )


def storage_dtype(layouts: list[UnitLayout]) -> str:
    """The storage dtype that keeps every recorded value: ``bfloat16`` (or ``float16``)
    when every unit that records reduces in it, else ``float32``."""
    wires = {layout.wire for layout in layouts if layout.records}
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    return names.get(wires.pop(), "float32") if len(wires) == 1 else "float32"


class CaptureReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """A unit's reduce-scatter: hand the input to ``record``, then run ``inner``."""

    def __init__(
        self,
        inner: Any,
        record: Callable[[torch.Tensor, int], None],
    ) -> None:
        self.inner = inner
        self.record = record

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op: Any,
        async_op: bool = False,
    ):
        self.record(input_tensor, group.size())
        return self.inner(
            output_tensor=output_tensor,
            input_tensor=input_tensor,
            group=group,
            op=op,
            async_op=async_op,
        )


def install(unit: nn.Module, record: Callable[[torch.Tensor, int], None], world_size: int) -> None:
    """Route ``unit``'s local gradient to ``record(flat_input, world_size)``.

    ``world_size`` is the unit's reduce-scatter group size; with 1 the all-reduce hook
    records (FSDP runs no reduce-scatter then), wrapping any hook the user set.
    """
    group = _param_group(unit)
    if world_size > 1:
        unit.set_custom_reduce_scatter(CaptureReduceScatter(group._reduce_scatter_comm, record))
        return
    inner = group._all_reduce_hook

    def hook(reduce_output: torch.Tensor) -> None:
        record(reduce_output, 1)
        if inner is not None:
            inner(reduce_output)

    unit.set_all_reduce_hook(hook)


def is_wrapped(unit: nn.Module) -> bool:
    """Whether ``unit`` already records into a capture (one capture per model)."""
    group = _param_group(unit)
    return group is not None and isinstance(group._reduce_scatter_comm, CaptureReduceScatter)
