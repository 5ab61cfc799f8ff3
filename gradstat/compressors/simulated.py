"""The replay of a compressor known only by its training form: every learner's ``online``
step run against a simulated communicator.

A compressor that needs every learner at once and has no streamed form of its own (a
user's class overriding ``online(p, name, comm)`` only) is replayed by
:class:`OnlineStream`: the learners' corrected rows are formed one at a time, then each
learner's ``online`` runs in a thread of its own and their collectives meet in a
:class:`SimulatedCommunicator` (sums in learner order, so the numbers are those of one
process adding the rows). It holds every learner's corrected row of the step (n rows),
where a streamed form holds one.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gradstat.compressors.communicator import Communicator
from gradstat.compressors.exchange import OnlineStep, StepOutcome, Stream, Transfer


class Hub:
    """Where ``size`` simulated learners meet: a barrier, one slot each, and a queue per
    (sender, receiver) pair for point-to-point messages."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size
        self.queues = {(a, b): queue.Queue() for a in range(size) for b in range(size)}

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every learner's ``value``, once all have arrived (then the slots are free)."""
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class SimulatedCommunicator(Communicator):
    """Learner ``rank``'s end of a :class:`Hub`: the collectives of
    :class:`~gradstat.compressors.communicator.Communicator` between threads."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size
        self.overhead_bytes = 0

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self.hub.exchange(self.rank, tensor.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return tensor.copy_(total)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone() for t in self.hub.exchange(self.rank, tensor.reshape(-1).clone())]

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        values = self.hub.exchange(self.rank, tensor.clone() if self.rank == root else None)
        return tensor.copy_(values[root])

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.hub.queues[self.rank, dst].put(tensor.clone())

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        while True:  # until the message comes, or another learner failed
            try:
                return tensor.copy_(self.hub.queues[src, self.rank].get(timeout=0.1))
            except queue.Empty:
                if self.hub.barrier.broken:
                    raise threading.BrokenBarrierError from None


def run_online(compressors: list[Any], rows: list[torch.Tensor], name: str) -> list[OnlineStep]:
    """Every learner's ``online`` step on its row, in threads meeting in one hub. A
    failure in one learner breaks the others' waits and is raised."""
    hub = Hub(len(rows))

    def one(i: int) -> OnlineStep:
        try:
            return compressors[i].online(rows[i], name, SimulatedCommunicator(hub, i))
        except BaseException:
            hub.barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=len(rows)) as pool:
        futures = [pool.submit(one, i) for i in range(len(rows))]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:  # the learner that failed, not those it left waiting
        broken = threading.BrokenBarrierError
        raise next((e for e in errors if not isinstance(e, broken)), errors[0])
    return [f.result() for f in futures]


class OnlineStream(Stream):
    """A compressor's ``online`` form as a replay step (see the module docstring)."""

    def __init__(self, scheme: Any, name: str, learners: int, numel: int) -> None:
        self.scheme, self.name, self.n, self.d = scheme, name, learners, numel
        self.memory = scheme.memory
        self.compressors = [scheme.for_learner(i) for i in range(learners)]

    def begin(self, read_row: Any) -> None:
        self.rows: list[tuple[torch.Tensor, Any]] = []

    def learner(self, i: int, g: torch.Tensor) -> None:
        p, state = self.memory.compensate(i, g)
        self.rows.append((p.clone(), state))

    def finish(self) -> StepOutcome:
        steps = run_online(self.compressors, [p for p, _ in self.rows], self.name)
        for i, ((p, state), step) in enumerate(zip(self.rows, steps, strict=True)):
            self.memory.update(i, p, step.sent, state)
        self.rows = []
        sent_any = torch.zeros(self.d, dtype=torch.bool)
        for step in steps:
            sent_any |= step.sent != 0
        kinds = [t.collective for t in steps[0].transfers]
        transfers = tuple(
            Transfer(kind, sum(s.transfers[j].nbytes for s in steps) / self.n)
            for j, kind in enumerate(kinds)
        )
        sparse = self.compressors[0].k is not None
        return StepOutcome(
            estimate=steps[0].estimate,
            transfers=transfers,
            selected=[s.selected for s in steps],
            memory_norm=self.memory.norm(),
            union=int(sent_any.sum()) if sparse else None,
        )
