"""Number formats on the wire: what a message of float32 values becomes when a collective
sends it in ``bf16``, ``fp16``, ``fp8-e4m3``, ``fp8-e5m2`` or an OCP MX format
(docs/lowprecision.md; /work/shared/METHODS.md section 7).

A :class:`Format` turns one message (1-D float32) into its wire payload
(:meth:`~Format.encode`: the tensors a learner sends, their real bytes) and back
(:meth:`~Format.decode`: float32), and rounds many messages at once
(:meth:`~Format.round`: each row of the last dim one message, equal to
``decode(encode(row))`` bit for bit), which the collective emulation
(:mod:`gradstat.wire.collectives`) applies hop by hop.

* ``fp32``: the values as they are (the exact baseline).
* ``bf16``, ``fp16``: torch's casts (round to nearest, ties to even; fp16 overflows to
  infinity past 65504, as on the wire).
* ``fp8-e4m3``, ``fp8-e5m2``: one float32 scale per message, ``s = amax / max_finite``
  (448 or 57344), elements ``(x / s).to(torch.float8_e4m3fn / float8_e5m2)`` (torch's
  round to nearest even), decoded as ``q * s``; an all-zero message has ``s = 1``.
* ``mxfp8`` (E4M3 elements), ``mxfp8-e5m2``, ``mxfp6`` (E2M3), ``mxfp6-e3m2``,
  ``mxfp4`` (E2M1): OCP MX v1.0, 32-element blocks with an E8M0 scale
  (:mod:`gradstat.wire.mx`).

Inputs must be finite (a capture's rows are checked before any analysis reads them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from gradstat.errors import UsageError
from gradstat.wire import mx

#: A wire payload: the tensors one message is sent as.
Payload = tuple[torch.Tensor, ...]


class Format(ABC):
    """A number format on the wire (``name`` as in :data:`FORMATS`)."""

    name: str

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Payload:
        """One message ``x`` (1-D float32) as the tensors sent on the wire."""

    @abstractmethod
    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        """The float32 values (``numel`` of them) of a payload made by :meth:`encode`."""

    @abstractmethod
    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., n) float32 as the wire carries it, each row one message: a new
        tensor equal to ``decode(encode(row))`` for every row, bit for bit."""

    @abstractmethod
    def wire_bytes(self, numel: int) -> int:
        """Bytes of one message of ``numel`` values (the payload's ``nbytes``)."""

    def __repr__(self) -> str:
        return self.name


class Cast(Format):
    """A plain cast to ``dtype`` (``fp32``: no change)."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype

    def encode(self, x: torch.Tensor) -> Payload:
        return (x.to(self.dtype, copy=True),)

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        return payload[0].to(torch.float32, copy=True)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:
            return x.clone()
        return x.to(self.dtype).to(torch.float32)

    def wire_bytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize


class ScaledFp8(Format):
    """An fp8 dtype with one float32 scale per message, ``amax / max_finite``."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.max_finite = float(torch.finfo(dtype).max)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's scale (keepdim), 1 where the row is all zeros."""
        amax = x.abs().amax(dim=-1, keepdim=True)
        return torch.where(amax > 0, amax / self.max_finite, torch.ones_like(amax))

    def encode(self, x: torch.Tensor) -> Payload:
        scale = self._scale(x.reshape(-1))
        return (x.reshape(-1) / scale).to(self.dtype).view(torch.uint8), scale

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        codes, scale = payload
        return codes.view(self.dtype).to(torch.float32) * scale

    def round(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._scale(x)
        return (x / scale).to(self.dtype).to(torch.float32) * scale

    def wire_bytes(self, numel: int) -> int:
        return numel + 4


class Mx(Format):
    """An OCP MX format: 32-element blocks, an E8M0 scale, ``element`` values."""

    def __init__(self, name: str, element: mx.Element) -> None:
        self.name, self.element = name, element

    def encode(self, x: torch.Tensor) -> Payload:
        return mx.encode(x, self.element)

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        scales, data = payload
        return mx.decode(scales, data, numel, self.element)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return mx.round_values(x, self.element)

    def wire_bytes(self, numel: int) -> int:
        return mx.wire_bytes(numel, self.element)


FORMATS: dict[str, Format] = {
    "fp32": Cast("fp32", torch.float32),
    "bf16": Cast("bf16", torch.bfloat16),
    "fp16": Cast("fp16", torch.float16),
    "fp8-e4m3": ScaledFp8("fp8-e4m3", torch.float8_e4m3fn),
    "fp8-e5m2": ScaledFp8("fp8-e5m2", torch.float8_e5m2),
    "mxfp8": Mx("mxfp8", mx.ELEMENTS["e4m3"]),
    "mxfp8-e5m2": Mx("mxfp8-e5m2", mx.ELEMENTS["e5m2"]),
    "mxfp6": Mx("mxfp6", mx.ELEMENTS["e2m3"]),
    "mxfp6-e3m2": Mx("mxfp6-e3m2", mx.ELEMENTS["e3m2"]),
    "mxfp4": Mx("mxfp4", mx.ELEMENTS["e2m1"]),
}


def wire_format(name: str | Format) -> Format:
    """The format called ``name`` (a :class:`Format` passes through); a ``UsageError``
    listing the names otherwise."""
    if isinstance(name, Format):
        return name
    if name not in FORMATS:
        raise UsageError(f"unknown number format {name!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[name]
