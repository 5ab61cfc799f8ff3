"""OCP Microscaling (MX) formats, v1.0: blocks of 32 elements share one E8M0 scale.

The math of the spec (OCP "Microscaling Formats (MX) Specification" v1.0, sections 5 and
6.3; /work/shared/METHODS.md section 7), on float32 torch tensors:

* A block's shared scale is ``X = 2^(floor(log2(amax)) - emax_elem)``, ``amax`` the
  largest magnitude in the block and ``emax_elem`` the exponent of the element format's
  largest normal; its E8M0 code is ``floor(log2(amax)) - emax_elem + 127``, clamped to
  ``0 .. 254`` (an all-zero block gets ``2^-127``).
* Each element is ``V_i / X`` clamped to the element's largest normal (saturation) and
  rounded to nearest, ties to even, to the element format (subnormals kept).
* Elements: FP8 E4M3 (max 448), FP8 E5M2 (57344), FP6 E2M3 (7.5), FP6 E3M2 (28), FP4
  E2M1 (6); none produces an infinity or a NaN here.

:func:`round_values` is what one message of MX values carries (``decode(encode(x))``):
the collective emulation's reference rounding (its compiled hops do the same arithmetic,
gradstat/wire/_hop_loops.py); :func:`encode` / :func:`decode` make and read the
wire payload: the E8M0 scales (one byte per block) and the element codes packed
as the wire carries them (FP8 one byte each, FP6 four in three bytes, FP4 two per byte,
the first element in the low bits). A message whose length is not a multiple of 32 ends
with a short block. Inputs must be finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

#: Elements that share one scale.
BLOCK = 32


@dataclass(frozen=True)
class Element:
    """An MX element format: sign, ``exp_bits`` exponent and ``man_bits`` mantissa bits,
    exponent bias ``2^(exp_bits - 1) - 1``; ``emax`` the exponent of its largest normal,
    ``max_normal`` that value."""

    name: str
    exp_bits: int
    man_bits: int
    emax: int
    max_normal: float

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal (subnormals below, spaced by
        ``2^(emin - man_bits)``)."""
        return 1 - self.bias

    @cached_property
    def values(self) -> torch.Tensor:
        """The float32 value of every code (the spec's formula; codes past
        ``max_normal``, E4M3's NaN and E5M2's infinities, are never produced)."""
        codes = torch.arange(2**self.bits)
        sign = 1.0 - 2.0 * ((codes >> (self.bits - 1)) & 1).double()
        exp = (codes >> self.man_bits) & (2**self.exp_bits - 1)
        man = (codes & (2**self.man_bits - 1)).double() / 2**self.man_bits
        normal = torch.exp2((exp - self.bias).double()) * (1 + man)
        subnormal = 2.0**self.emin * man
        return (sign * torch.where(exp == 0, subnormal, normal)).float()


ELEMENTS = {
    "e4m3": Element("e4m3", 4, 3, 8, 448.0),
    "e5m2": Element("e5m2", 5, 2, 15, 57344.0),
    "e2m3": Element("e2m3", 2, 3, 2, 7.5),
    "e3m2": Element("e3m2", 3, 2, 4, 28.0),
    "e2m1": Element("e2m1", 2, 1, 2, 6.0),
}


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., n) as (..., ceil(n / 32), 32), zero-padded (zeros change no amax)."""
    n = x.shape[-1]
    pad = -n % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (n + pad) // BLOCK, BLOCK)


def shared_exponents(blocks: torch.Tensor, element: Element) -> torch.Tensor:
    """Each block's ``floor(log2(amax)) - emax`` clamped to ``-127 .. 127`` (int32): the
    float32 exponent field of ``amax`` gives ``floor(log2)`` exactly (a subnormal or
    zero ``amax`` lands below -127 and is clamped)."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    field = (amax.view(torch.int32) >> 23) & 0xFF
    return (field - 127 - element.emax).clamp_(-127, 127)


def _powers_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """``2^e`` in float32, built from its bits (exact; ``2^-127`` is subnormal)."""
    normal = ((exponents + 127).clamp(min=1) << 23).view(torch.float32)
    return torch.where(exponents >= -126, normal, torch.tensor(2.0**-127))


def round_element(v: torch.Tensor, element: Element) -> torch.Tensor:
    """``v`` (float32, ``|v| <= max_normal``) rounded to nearest, ties to even, to the
    element format: normals by rounding the float32 mantissa to ``man_bits`` bits
    (integer add-and-mask; a carry moves into the exponent), subnormals by adding and
    subtracting ``2^(emin - man_bits + 23)`` (float32 addition rounds ties to even at
    that spacing)."""
    drop = 23 - element.man_bits
    bits = v.view(torch.int32)
    lsb = (bits >> drop) & 1
    normal = ((bits + (1 << (drop - 1)) - 1 + lsb) & ~((1 << drop) - 1)).view(torch.float32)
    magic = 2.0 ** (element.emin - element.man_bits + 23)
    subnormal = ((v.abs() + magic) - magic).copysign(v)
    return torch.where(v.abs() < 2.0**element.emin, subnormal, normal)


def _scaled(x: torch.Tensor, element: Element) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' shared exponents and the elements ``V / X``, rounded."""
    blocks = _blocks(x)
    exponents = shared_exponents(blocks, element)
    v = (blocks / _powers_of_two(exponents)).clamp_(-element.max_normal, element.max_normal)
    return exponents, round_element(v, element)


def round_values(x: torch.Tensor, element: Element) -> torch.Tensor:
    """``x`` (..., n) float32 as MX carries it, each row (last dim) one message:
    ``P_i * X`` per block, float32 (exact: ``X`` is a power of two)."""
    exponents, rounded = _scaled(x, element)
    out = (rounded * _powers_of_two(exponents)).flatten(-2)
    return out[..., : x.shape[-1]]


def _codes(rounded: torch.Tensor, element: Element) -> torch.Tensor:
    """The element codes (sign, exponent field, mantissa) of rounded values (int32)."""
    bits = rounded.view(torch.int32)
    sign = (bits >> 31) & 1
    magnitude = bits & 0x7FFFFFFF
    field = (magnitude >> 23) - 127 + element.bias
    man = (magnitude >> (23 - element.man_bits)) & (2**element.man_bits - 1)
    sub = (rounded.abs() * 2.0 ** (element.man_bits - element.emin)).to(torch.int32)
    normal = field >= 1
    field = torch.where(normal, field, torch.zeros_like(field))
    man = torch.where(normal, man, sub)
    return (sign << (element.bits - 1)) | (field << element.man_bits) | man


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``bits`` bits (1-D) packed into bytes, the first in the low bits."""
    per = {8: 1, 6: 4, 4: 2}[bits]
    codes = torch.nn.functional.pad(codes, (0, -codes.numel() % per)).view(-1, per)
    if bits == 8:
        return codes.reshape(-1).to(torch.uint8)
    if bits == 4:
        return (codes[:, 0] | (codes[:, 1] << 4)).to(torch.uint8)
    word = codes[:, 0] | (codes[:, 1] << 6) | (codes[:, 2] << 12) | (codes[:, 3] << 18)
    return (
        torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=1)
        .reshape(-1)
        .to(torch.uint8)
    )


def _unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` codes (int64) of bytes packed by :func:`_pack`."""
    data = data.to(torch.int64)
    if bits == 8:
        return data[:numel]
    if bits == 4:
        codes = torch.stack([data & 0xF, data >> 4], dim=1)
    else:
        three = data.view(-1, 3)
        word = three[:, 0] | (three[:, 1] << 8) | (three[:, 2] << 16)
        codes = torch.stack([(word >> (6 * k)) & 0x3F for k in range(4)], dim=1)
    return codes.reshape(-1)[:numel]


def encode(x: torch.Tensor, element: Element) -> tuple[torch.Tensor, torch.Tensor]:
    """One message ``x`` (1-D float32) as its wire payload: the E8M0 scale codes (uint8,
    one per block) and the packed element codes (uint8)."""
    exponents, rounded = _scaled(x.reshape(-1), element)
    codes = _codes(rounded.reshape(-1)[: x.numel()], element)
    return (exponents.reshape(-1) + 127).to(torch.uint8), _pack(codes, element.bits)


def decode(scales: torch.Tensor, data: torch.Tensor, numel: int, element: Element):
    """The float32 values of a payload made by :func:`encode` (``numel`` elements)."""
    values = element.values[_unpack(data, element.bits, numel)]
    exponents = scales.to(torch.int32) - 127
    return (_blocks(values) * _powers_of_two(exponents).unsqueeze(-1)).reshape(-1)[:numel]


def wire_bytes(numel: int, element: Element) -> int:
    """Bytes of a message of ``numel`` elements: packed elements plus one scale byte
    per block."""
    per = {8: 1, 6: 4, 4: 2}[element.bits]
    packed = -(-numel // per) * element.bits * per // 8
    return packed + -(-numel // BLOCK)
