"""How one learner talks to the others: the collectives a compressor's exchange needs.

GRACE's Communicator, small: :class:`Communicator` names the collectives (``rank``,
``size``, :meth:`~Communicator.allreduce`, :meth:`~Communicator.allgather`,
:meth:`~Communicator.broadcast`, point-to-point :meth:`~Communicator.send` /
:meth:`~Communicator.recv` for trees). :class:`TorchCommunicator` runs them with
``torch.distributed`` on a process group (the DDP communication hook). The replay's side
of the same exchange is the compressor's :class:`~gradstat.compressors.exchange.Stream`: rows
arrive one learner at a time and what a collective would hand every learner is formed as
they arrive (a running sum for an all-reduce, the payloads for an all-gather, the
leader's row read first for a broadcast).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from gradstat.compressors.exchange import nbytes


class Communicator(ABC):
    """One learner's end of the collectives (``rank`` of ``size`` learners)."""

    rank: int
    size: int

    @abstractmethod
    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of every learner's ``tensor`` (in place)."""

    @abstractmethod
    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every learner's 1-D ``tensor`` (lengths may differ), in rank order."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """``root``'s ``tensor`` on every learner (in place; same shape everywhere)."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to learner ``dst``."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``tensor`` from learner ``src``."""

    #: bytes this learner sent beyond its payload since the counter was reset
    #: (all-gather lengths and padding, tree bookkeeping)
    overhead_bytes: int = 0


class TorchCommunicator(Communicator):
    """The collectives of ``torch.distributed`` on ``group`` (None: the default group).

    Ranks are ranks within ``group``; point-to-point calls translate them to global
    ranks. Payloads of different lengths are all-gathered padded to the longest, after
    an all-gather of the lengths; both count as ``overhead_bytes``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.overhead_bytes = 0

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        length = torch.tensor([tensor.numel()], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(lengths, length, group=self.group)
        sizes = [int(n) for n in lengths]
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=tensor.dtype)
        padded[: tensor.numel()] = tensor.reshape(-1)
        gathered = [torch.empty(longest, dtype=tensor.dtype) for _ in range(self.size)]
        dist.all_gather(gathered, padded, group=self.group)
        self.overhead_bytes += (longest - tensor.numel()) * tensor.element_size()
        self.overhead_bytes += nbytes(length)
        return [g[:size] for g, size in zip(gathered, sizes, strict=True)]

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        dist.broadcast(tensor, src=self._global(root), group=self.group)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor, self._global(dst), group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, self._global(src), group=self.group)
        return tensor
