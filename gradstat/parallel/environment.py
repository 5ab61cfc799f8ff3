"""torchrun's environment, read without importing torch (the command line asks it
before it knows whether the command computes)."""

from __future__ import annotations

import os


def launched_by_torchrun() -> bool:
    """Whether this process is one of several ranks started by torchrun."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False
