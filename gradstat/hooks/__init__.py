"""Compressors as DDP communication hooks (docs/online.md).

``compression_hook(name, ratio=..., **params)`` returns ``(hook, state)`` for
``ddp.register_comm_hook(state, hook)``; the compressors and memories are the replay's.
"""

from gradstat.hooks.compression import CompressionState, compression_hook

__all__ = ["CompressionState", "compression_hook"]
