"""Training's side of every exchange: one learner's collectives with ``torch.distributed``.

:class:`TorchCommunicator` drives a compressor's exchange (:meth:`Compressor.exchange
<gradstat.compressors.base.Compressor.exchange>`, the generator the replay drives with a
simulated communicator, :mod:`gradstat.compressors.simulated`) on a process group: each
op it yields becomes the collective on this learner (all-reduce, all-gather, broadcast,
a round of point-to-point sends and receives) and each :class:`~gradstat.compressors.
exchange.Shared` function runs here, as it does on every learner. Payloads of different
lengths are all-gathered padded to the longest, after an all-gather of the lengths; both
count as ``overhead_bytes``.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

from gradstat.compressors.exchange import (
    AllGather,
    AllReduce,
    Broadcast,
    Round,
    Sent,
    Shared,
    drive,
    nbytes,
)


class TorchCommunicator:
    """This learner's collectives of ``torch.distributed`` on ``group`` (None: the
    default group); ranks are ranks within ``group``."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.overhead_bytes = 0

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def run(self, exchange: Generator) -> Sent:
        """Drive ``exchange`` to its end; its outcome, with the overhead bytes it took."""
        before = self.overhead_bytes
        result = drive(exchange, self.answer)
        result.overhead_bytes += self.overhead_bytes - before
        return result

    def answer(self, op: Any) -> Any:
        """What this learner receives for ``op``."""
        if isinstance(op, AllReduce):
            summed = [t.clone() for t in op.tensors]
            for t in summed:
                dist.all_reduce(t, group=self.group)
            return summed
        if isinstance(op, AllGather):
            columns = [self.allgather(t) for t in op.tensors]
            return [[column[i] for column in columns] for i in range(self.size)]
        if isinstance(op, Broadcast):
            tensor = op.tensor.clone()
            dist.broadcast(tensor, src=self._global(op.root), group=self.group)
            return tensor
        if isinstance(op, Round):
            return self.round(op)
        if isinstance(op, Shared):
            return op.function(*op.args)
        raise TypeError(f"an exchange yielded {type(op).__name__}, not a collective")

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every learner's ``tensor`` (lengths may differ), in rank order, in its shape."""
        flat = tensor.reshape(-1)
        length = torch.tensor([flat.numel()], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(lengths, length, group=self.group)
        sizes = [int(n) for n in lengths]
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=flat.dtype)
        padded[: flat.numel()] = flat
        gathered = [torch.empty(longest, dtype=flat.dtype) for _ in range(self.size)]
        dist.all_gather(gathered, padded, group=self.group)
        self.overhead_bytes += (longest - flat.numel()) * flat.element_size() + nbytes(length)
        shaped = tensor.dim() != 1 and len(set(sizes)) == 1
        return [
            g[:size].reshape(tensor.shape) if shaped else g[:size]
            for g, size in zip(gathered, sizes, strict=True)
        ]

    def round(self, op: Round) -> dict[int, list[torch.Tensor]]:
        """One round of point-to-point messages: sends and receives posted together."""
        works, received = [], {}
        for peer, tensors in op.sends.items():
            works += [
                dist.isend(t.contiguous(), self._global(peer), group=self.group) for t in tensors
            ]
        for peer, templates in op.receives.items():
            received[peer] = [torch.empty(shape, dtype=dtype) for shape, dtype in templates]
            works += [dist.irecv(t, self._global(peer), group=self.group) for t in received[peer]]
        for work in works:
            work.wait()
        return received
