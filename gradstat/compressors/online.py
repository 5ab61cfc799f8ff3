"""The generic training step of a GRACE-style compressor: one learner, real collectives.

``tensors, ctx = compress(p, name)``; then by the compressor's ``collective``:

* ``allgather``: every payload tensor is all-gathered (padded to the longest when lengths
  differ, :class:`~gradstat.compressors.communicator.TorchCommunicator`), every learner
  decompresses every payload with its own ``ctx`` and ``aggregate`` combines them;
* ``allreduce``: the payload tensors are summed element-wise and decompressed once.

With ``average`` the aggregate is divided by the number of learners. What this learner
sent is its own ``decompress``; the bytes are its payload tensors' sizes, what goes
beyond (lengths, padding) is ``overhead_bytes``.
"""

from __future__ import annotations

from typing import Any

import torch

from gradstat.compressors.communicator import Communicator
from gradstat.compressors.exchange import OnlineStep, Tensors, Transfer, nbytes


def selected_of(compressor: Any, tensors: Tensors, sent: torch.Tensor) -> int:
    """Elements a payload carries: its index tensor's length (``sparse``), the sent
    vector's non-zeros (``sparse`` None) or all of them."""
    if compressor.sparse:
        return int(tensors[0].numel())
    if compressor.sparse is None:
        return int(torch.count_nonzero(sent))
    return int(sent.numel())


def _gathered(comm: Communicator, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every learner's ``tensor``, flat, or in its shape when it is not 1-D."""
    gathered = comm.allgather(tensor.reshape(-1))
    if tensor.dim() == 1:
        return gathered
    return [g.reshape(tensor.shape) for g in gathered]


def local_online(compressor: Any, p: torch.Tensor, name: str, comm: Communicator) -> OnlineStep:
    """One learner's step of ``compressor`` on its corrected vector ``p``."""
    before = comm.overhead_bytes
    tensors, ctx = compressor.compress(p, name)
    sent = compressor.decompress(tensors, ctx).clone()
    size = sum(nbytes(t) for t in tensors)
    selected = selected_of(compressor, tensors, sent)
    collective = compressor.collective
    if collective == "allreduce":
        summed = [comm.allreduce(t.clone()) for t in tensors]
        total = compressor.decompress(summed, ctx)
    else:
        columns = [_gathered(comm, t) for t in tensors]
        payloads = [[column[i] for column in columns] for i in range(comm.size)]
        decoded = [compressor.decompress(q, ctx) for q in payloads]
        decoded[comm.rank] = sent  # bit-identical to what this learner decoded itself
        total = compressor.aggregate(decoded)
    estimate = total / comm.size if compressor.average else total
    transfer = Transfer(collective, size)
    return OnlineStep(sent, estimate, (transfer,), selected, comm.overhead_bytes - before)
