"""Where and with how much an analysis computes: device, worker processes, memory.

:class:`Compute` is the one object every analysis takes besides the capture, the
selection and its parameters. ``device``: ``"auto"`` (a CUDA GPU when one is available,
else the CPU), ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``); rows are read on the CPU and
moved to the device after reading. ``jobs``: worker processes (None: this process alone,
the default). ``memory``: bytes an analysis may hold in full-length rows; when one
row of a scope does not fit, the streaming analyses work in column blocks
(:meth:`Compute.block_numel`). None: a share of the memory available when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradstat.errors import UsageError

DEVICES = ("auto", "cpu", "cuda")
#: Share of the available memory an analysis takes for rows when ``memory`` is not given.
MEMORY_SHARE = 0.25
#: Full-length float32 rows alive at once in the streaming analyses (a pair of learners'
#: rows being scanned, the next two being read, the running mean's sum and its
#: compensation), what ``block_numel`` budgets for.
ROWS_ALIVE = 6
#: Smallest column block: below this per-block overhead dominates.
MIN_BLOCK = 1 << 16
#: Smallest ``memory``: 1 MiB (a budget this small still gets blocks of ``MIN_BLOCK``).
MIN_MEMORY = 1 << 20
#: Largest column block, whatever the budget: six float32 buffers of 16M values are
#: 384 MiB. Longer rows (32M-1B values) are read in blocks (the row's CRC-32C runs on from
#: block to block) and a top-k over blocks is exact (figures: docs/large.md).
MAX_BLOCK = 1 << 24


def available_memory() -> int:
    """Bytes the kernel reports available (MemAvailable), or 4 GiB where it cannot say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


@dataclass(frozen=True)
class Compute:
    """Device, worker processes and memory budget of one analysis run (module docstring)."""

    device: str = "auto"
    jobs: int | None = None
    memory: int | None = None

    def __post_init__(self) -> None:
        base = self.device.split(":")[0]
        if base not in DEVICES or (":" in self.device and base != "cuda"):
            raise UsageError(f"device={self.device!r}: choose auto, cpu or cuda")
        if self.jobs is not None and self.jobs < 1:
            raise UsageError(f"jobs={self.jobs}: use at least 1 worker")
        if self.memory is not None and self.memory < MIN_MEMORY:
            raise UsageError(f"memory={self.memory}: give at least {MIN_MEMORY} bytes")

    def torch_device(self) -> torch.device:
        """The device to compute on; ``cuda`` without a usable GPU is a ``UsageError``."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError(f"device={self.device!r}: no CUDA GPU is available here")
        return torch.device(self.device)

    def memory_bytes(self) -> int:
        """The row budget: ``memory``, or ``MEMORY_SHARE`` of the available memory."""
        if self.memory is not None:
            return self.memory
        return int(available_memory() * MEMORY_SHARE)

    def block_numel(self, numel: int) -> int:
        """Columns per block so that ``ROWS_ALIVE`` float32 rows of a block fit the budget,
        at most ``MAX_BLOCK``: ``numel`` itself (one block) when a whole row fits."""
        fits = min(MAX_BLOCK, max(MIN_BLOCK, self.memory_bytes() // (4 * ROWS_ALIVE)))
        return numel if numel <= fits else fits
