"""The communication plan: how one step is cut into messages, as training cuts it.

Replay, recommend, the report, the DDP hook, ``compare`` and the cost model share one
:class:`Plan`, built from the capture's layer table (each trainable parameter's slice of
the flat row, in ``named_parameters`` order) by :func:`build_plan` at a granularity:

* ``model``: one message, the whole flat vector (every parameter end to end);
* ``tensor``: one message per parameter, handed to the compressor in its shape (as
  GRACE compresses each tensor, docs/methods.md 6);
* ``bucket[:MB]``: DistributedDataParallel's gradient buckets, each one flat message in
  the order DDP hands them to its hook. DDP's rule, from its behaviour: parameters in
  reverse registration order (their gradients' order in backward) fill a bucket until it
  holds at least its cap, 1 MiB for the first and ``bucket_cap_mb`` (25 by default, in
  MiB) for the others, or the explicit ``bucket_cap_mb`` for all (DDP's first iteration
  is one bucket; the hook compresses the plan's messages whatever bucket carried them);
* ``unit``: FSDP2's ``fully_shard`` units, each one flat message of its recorded
  parameters in the unit's order (a capture's ``fsdp_units``), as FSDP reduce-scatters
  them; compressors run inside that reduce-scatter (a format's collective is a
  reduce-scatter there, :mod:`gradstat.compressors.cast`). Under HSDP (a unit's
  ``replicate`` > 1) each shard group exchanges the message among itself, then the
  groups' means are averaged: densely, as FSDP's replicate all-reduce does
  (:attr:`Message.replicate`), or compressed, as gradstat's own ``--hsdp`` runs it
  (:attr:`Message.replicate_compressed`: the R learners holding one shard index
  exchange their groups' shards of it, :func:`replicate_plan`).

``--dense REGEX`` and ``--dense-below N`` keep matching or small parameters out of the
compressed messages: in each group (the model, a bucket) they travel as one more message
sent uncompressed (a float32 all-reduce, no memory), as torch_cgx and PowerSGD send
biases and norms. A compressor applies its density to each message by its own rule.

A plan also groups its messages into :class:`Block`\\ s: column ranges a replay reads
together (every message of a block is replayed in lockstep while the block's rows of
every learner are held; the model is one block, a bucket is one, consecutive tensors
share blocks of about :data:`BLOCK` values).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradstat.errors import UsageError
from gradstat.wire.shards import pieces, shard_numel

if TYPE_CHECKING:
    from gradstat.store.schema import Layer

GRANULARITIES = ("model", "tensor", "bucket", "unit")
#: DDP's defaults: ``bucket_cap_mb`` (MiB) and the first bucket's cap (bytes).
DDP_BUCKET_CAP_MB = 25.0
DDP_FIRST_BUCKET_BYTES = 1 << 20
MIB = 1 << 20
#: Values of consecutive tensors a replay reads (and holds per learner) together.
BLOCK = 1 << 22
#: An FSDP unit of a capture: ``(name, [layer names], replicate, replicate_compressed)``.
UnitMembers = tuple[str, Sequence[str], int, bool]


@dataclass(frozen=True)
class Message:
    """One message: ``slices`` (offset, numel) of the flat row in message order, the
    ``shapes`` of the parameters they hold, the ``shape`` the compressor receives (the
    parameter's at ``tensor`` granularity, else flat), whether it goes ``dense``, and
    ``replicate`` R: HSDP's shard groups of N/R consecutive learners (a ``(replicate,
    shard)`` mesh's) that each exchange it, their means then averaged; 1: one group.
    ``replicate_compressed``: that average is a second exchange through the compressor
    (:func:`replicate_plan`), not FSDP's dense all-reduce."""

    name: str
    slices: tuple[tuple[int, int], ...]
    shapes: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]
    dense: bool = False
    replicate: int = 1
    replicate_compressed: bool = False

    @property
    def numel(self) -> int:
        return sum(numel for _, numel in self.slices)


@dataclass(frozen=True)
class Block:
    """Columns read together: ``slices`` of the flat row in column order, and each of its
    messages (indices into the plan) as ``(start, stop)`` ranges of the block's row."""

    slices: tuple[tuple[int, int], ...]
    messages: tuple[int, ...]
    ranges: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def numel(self) -> int:
        return sum(numel for _, numel in self.slices)


@dataclass(frozen=True)
class Plan:
    """How a step is cut into messages (see the module docstring)."""

    granularity: str
    messages: tuple[Message, ...]
    blocks: tuple[Block, ...]

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.messages)

    @property
    def compressed(self) -> list[int]:
        """Indices of the messages a compressor handles (not sent dense)."""
        return [i for i, m in enumerate(self.messages) if not m.dense]

    def describe(self) -> str:
        """``bucket:25 (6 messages, 2 dense)``: what every answer says ran."""
        dense = len(self.messages) - len(self.compressed)
        extra = f", {dense} dense" if dense else ""
        count = len(self.messages)
        return f"{self.granularity} ({count} message{'s' * (count != 1)}{extra})"


def parse_granularity(text: str) -> tuple[str, float | None]:
    """``(kind, bucket_cap_mb)`` of ``model``, ``tensor``, ``bucket``, ``bucket:MB`` or
    ``unit`` (a usage error otherwise)."""
    kind, _, size = text.partition(":")
    if kind not in GRANULARITIES or (size and kind != "bucket"):
        raise UsageError(
            f"--granularity {text!r}: choose model, tensor, bucket[:MB] or unit (docs/replay.md)"
        )
    if not size:
        return kind, None
    try:
        cap = float(size)
    except ValueError:
        cap = math.nan
    if not (cap > 0 and math.isfinite(cap)):
        raise UsageError(f"--granularity {text!r}: the bucket cap must be a positive MiB count")
    return kind, cap


def ddp_bucket_caps(model: object) -> tuple[int, int] | None:
    """``(bucket cap, first bucket cap)`` in bytes of a DistributedDataParallel model
    (None for another model): its ``bucket_bytes_cap``, and 1 MiB for the first bucket
    where DDP uses its default caps (``bucket_bytes_cap_default``), else the cap."""
    cap = getattr(model, "bucket_bytes_cap", None)
    if not isinstance(cap, int):
        return None
    small_first = bool(getattr(model, "bucket_bytes_cap_default", False))
    return cap, DDP_FIRST_BUCKET_BYTES if small_first else cap


def ddp_buckets(
    layers: Sequence[Layer], cap_bytes: int, first_bytes: int, element_size: int = 4
) -> list[list[Layer]]:
    """DDP's buckets of ``layers`` (see the module docstring): in reverse order, a
    bucket closes once it holds at least its cap (``first_bytes`` for the first)."""
    buckets: list[list[Layer]] = []
    current: list[Layer] = []
    size, limit = 0, first_bytes
    for layer in reversed(layers):
        current.append(layer)
        size += layer.numel * element_size
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


def unit_members(
    units: str | Sequence[Mapping[str, Any]] | None, table: Sequence[Layer]
) -> list[UnitMembers]:
    """FSDP units as a capture records them (``fsdp_units``: JSON, or its list of
    ``{"name", "layers", "replicate", "replicate_compressed"}`` with indices into the
    layer ``table``) as ``(unit, [layer names in the unit's order], replicate,
    replicate_compressed)``; a ``UsageError`` when there are none."""
    if isinstance(units, str):
        units = json.loads(units)
    if not units:
        raise UsageError(
            "--granularity unit cuts a step into FSDP2's fully_shard units: it needs a "
            "capture of an FSDP2 run (gradstat capture --fsdp, or GradientCapture of a "
            "fully_shard model)"
        )
    return [
        (
            str(u["name"]),
            [table[int(i)].name for i in u["layers"]],
            int(u.get("replicate", 1)),
            bool(u.get("replicate_compressed", False)),
        )
        for u in units
    ]


def _units(
    layers: Sequence[Layer], units: Sequence[UnitMembers] | None
) -> list[tuple[str, list[Layer]]]:
    """Each FSDP unit's layers in the unit's order (layers outside ``layers``, a
    scope, are left out)."""
    if not units:
        unit_members(None, layers)  # the error: no unit to cut by
    by_name = {layer.name: layer for layer in layers}
    groups = [(name, [by_name[n] for n in members if n in by_name]) for name, members, *_ in units]
    return [(name, inside) for name, inside in groups if inside]


def _groups(
    layers: Sequence[Layer],
    kind: str,
    cap_mb: float | None,
    first_bytes: int | None,
    units: Sequence[UnitMembers] | None = None,
) -> list[tuple[str, list[Layer]]]:
    if kind == "unit":
        return _units(layers, units)
    if kind == "model":
        return [("model", list(layers))]
    if kind == "tensor":
        return [(layer.name, [layer]) for layer in layers]
    cap = int((DDP_BUCKET_CAP_MB if cap_mb is None else cap_mb) * MIB)
    if first_bytes is None:
        first_bytes = DDP_FIRST_BUCKET_BYTES if cap_mb is None else cap
    buckets = ddp_buckets(layers, cap, first_bytes)
    return [(f"bucket{i}", bucket) for i, bucket in enumerate(buckets)]


def _message(
    name: str,
    layers: Sequence[Layer],
    kind: str,
    dense: bool,
    replicate: tuple[int, bool] = (1, False),
) -> Message:
    shapes = tuple(tuple(layer.shape) for layer in layers)
    numel = sum(layer.numel for layer in layers)
    shape = shapes[0] if kind == "tensor" and len(layers) == 1 else (numel,)
    slices = tuple((layer.offset, layer.numel) for layer in layers)
    return Message(name, slices, shapes, shape, dense, *replicate)


def _blocks(messages: Sequence[Message], kind: str) -> tuple[Block, ...]:
    """Messages of a group together (a bucket's compressed and dense parts); at tensor
    granularity consecutive messages up to :data:`BLOCK` values."""
    groups: list[list[int]] = []
    for i, message in enumerate(messages):
        group = message.name.removesuffix(" (dense)")
        if groups:
            previous = messages[groups[-1][-1]].name.removesuffix(" (dense)")
            size = sum(messages[j].numel for j in groups[-1])
            if group == previous or (kind == "tensor" and size + message.numel <= BLOCK):
                groups[-1].append(i)
                continue
        groups.append([i])
    return tuple(_block(messages, group) for group in groups)


def _block(messages: Sequence[Message], members: Sequence[int]) -> Block:
    pieces = sorted(piece for i in members for piece in messages[i].slices)
    merged = _joined([(offset, offset + numel) for offset, numel in pieces])
    local, position = {}, 0  # flat offset of each piece -> its place in the block's row
    for offset, numel in pieces:
        local[offset] = position
        position += numel
    ranges = tuple(
        _joined([(local[offset], local[offset] + numel) for offset, numel in messages[i].slices])
        for i in members
    )
    return Block(tuple((start, stop - start) for start, stop in merged), tuple(members), ranges)


def _joined(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Ranges with each one that starts where the one before stops joined to it (a
    block's columns read at once; a message of one range is a view of its block's row)."""
    joined: list[tuple[int, int]] = []
    for start, stop in ranges:
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], stop)
        else:
            joined.append((start, stop))
    return tuple(joined)


def regrouped(plan: Plan, messages: Sequence[Message]) -> Plan:
    """``plan`` over other ``messages``, one for each of its own (e.g. a column sample of
    each, :mod:`gradstat.analysis.screening`): the same granularity, and blocks of the
    same members."""
    if len(messages) != len(plan.messages):
        raise ValueError(f"{len(messages)} messages for a plan of {len(plan.messages)}")
    blocks = tuple(_block(messages, block.messages) for block in plan.blocks)
    return Plan(plan.granularity, tuple(messages), blocks)


def build_plan(
    layers: Sequence[Layer],
    granularity: str = "model",
    *,
    dense: str | None = None,
    dense_below: int = 0,
    first_bucket_bytes: int | None = None,
    units: Sequence[UnitMembers] | None = None,
    replicate_compressed: bool | None = None,
) -> Plan:
    """The plan of ``layers`` at ``granularity`` (``model``, ``tensor``, ``bucket[:MB]``,
    ``unit``) with the parameters matching the regex ``dense`` or smaller than
    ``dense_below`` values sent uncompressed; ``first_bucket_bytes`` overrides the first
    bucket's cap (a capture's record of its DDP's); ``units``: the FSDP units of a
    ``unit`` plan, ``(name, [layer names], replicate, replicate_compressed)``
    (:func:`unit_members`); ``replicate_compressed`` (None: as each unit records)
    overrides the replicate stage of every unit replicated over R > 1 (a compressed
    run's plan replayed on a dense run's capture). A unit whose replicate stage is
    compressed takes no dense parameter (its shards hold every parameter of the unit)."""
    kind, cap_mb = parse_granularity(granularity)
    try:
        pattern = re.compile(dense) if dense else None
    except re.error as exc:
        raise UsageError(f"--dense {dense!r} is not a valid regex: {exc}") from None
    if dense_below < 0:
        raise UsageError(f"--dense-below {dense_below}: must be >= 0")

    def sent_dense(layer: Layer) -> bool:
        return layer.numel < dense_below or bool(pattern and pattern.search(layer.name))

    replicas = {
        name: (r, compressed if replicate_compressed is None else replicate_compressed and r > 1)
        for name, _, r, compressed in units or ()
    }
    messages: list[Message] = []
    for name, group in _groups(layers, kind, cap_mb, first_bucket_bytes, units):
        compressed = [layer for layer in group if not sent_dense(layer)]
        plain = [layer for layer in group if sent_dense(layer)]
        r = replicas.get(name, (1, False))
        if plain and r[1]:
            raise UsageError(
                f"FSDP unit {name}: --dense and --dense-below are not supported where HSDP's "
                "replicate stage is compressed (each shard holds every parameter of the unit)"
            )
        if compressed:
            messages.append(_message(name, compressed, kind, False, r))
        if plain:
            dense_name = name if kind == "tensor" else f"{name} (dense)"
            messages.append(_message(dense_name, plain, kind, True, r))
    label = granularity if cap_mb is None else f"bucket:{cap_mb:g}"
    return Plan(label, tuple(messages), _blocks(messages, kind))


def replicate_plan(plan: Plan, shards: int) -> Plan:
    """The second stage of HSDP's compressed replicate all-reduce (the messages of
    ``plan`` with :attr:`Message.replicate_compressed` use it; ``shards`` learners in a
    shard group): message ``m`` becomes ``shards`` messages (index ``m * shards + s``, named
    ``"NAME shard s"``), learner s's shard of the shard group's mean in FSDP's layout
    (:func:`gradstat.wire.shards.shard_of`, padding included), which the R
    learners holding shard s exchange (an all-reduce among them: the plan's granularity
    is ``replicate``, so a format's collective is an all-reduce, not a unit's
    reduce-scatter); one block per message of ``plan``."""
    messages: list[Message] = []
    offset = 0
    for message in plan.messages:
        numel = shard_numel(pieces(message.shapes), shards)
        for s in range(shards):
            name = f"{message.name} shard {s}"
            messages.append(Message(name, ((offset, numel),), ((numel,),), (numel,)))
            offset += numel
    members = [range(m * shards, (m + 1) * shards) for m in range(len(plan.messages))]
    blocks = tuple(_block(messages, list(block)) for block in members)
    return Plan("replicate", tuple(messages), blocks)
