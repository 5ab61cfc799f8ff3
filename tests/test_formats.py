"""Number formats on the wire (gradstat/wire/formats.py, mx.py) against independent
references: torch's own casts for bf16, fp16 and the scaled fp8 formats, and for the MX
formats a plain element-by-element reference written here from the OCP MX v1.0 spec (no
code shared with gradstat): shared scale ``2^(floor(log2 amax) - emax)``, elements
clamped to the largest normal and rounded to the nearest value, ties to the even code."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gradstat.errors import UsageError
from gradstat.wire.formats import FORMATS, wire_format


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _data(seed: int = 0, n: int = 1000) -> torch.Tensor:
    """Values over many magnitudes (float32 subnormals to 1e30), signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 100, (n,), generator=g))
    x[:4] = torch.tensor([0.0, -0.0, 1e-45, -3e38])
    return x


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16_bit_formats_are_torchs_casts(name, dtype):
    fmt = FORMATS[name]
    x = _data()
    # ties: halfway between neighbours of the format (round to the even one)
    one = torch.tensor(1.0)
    ulp = float(torch.nextafter(one.to(dtype), torch.tensor(2.0).to(dtype)).float() - 1)
    x = torch.cat([x, torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2)])])
    (payload,) = fmt.encode(x)
    assert payload.dtype == dtype
    assert torch.equal(payload.view(torch.int16), x.to(dtype).view(torch.int16))
    assert torch.equal(_bits(fmt.decode((payload,), x.numel())), _bits(x.to(dtype).float()))
    assert fmt.wire_bytes(x.numel()) == payload.nbytes


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp8-e4m3", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2)]
)
def test_fp8_formats_scale_by_amax_and_cast_with_torch(name, dtype):
    fmt = FORMATS[name]
    top = float(torch.finfo(dtype).max)
    # scale 1 (amax = max finite): ties of the format round to even; then wide data
    ties = torch.tensor([top, 1.0625, 1.1875, -1.0625, 0.0, 2.0**-10, 2.0**-17])
    for x in (ties, _data(1, 300), torch.zeros(5)):
        amax = x.abs().max()
        scale = amax / top if amax > 0 else torch.tensor(1.0)
        expected = (x / scale).to(dtype)
        codes, sent_scale = fmt.encode(x)
        assert torch.equal(codes, expected.view(torch.uint8))
        assert torch.equal(_bits(sent_scale.reshape(())), _bits(scale))
        decoded = fmt.decode((codes, sent_scale), x.numel())
        assert torch.equal(_bits(decoded), _bits(expected.float() * scale))
        assert fmt.wire_bytes(x.numel()) == codes.nbytes + sent_scale.nbytes


# --- the OCP MX reference, element by element ---------------------------------------
# element: exponent bits, mantissa bits, emax, largest normal (spec table 1 and 5.3)
SPEC = {
    "mxfp8": (4, 3, 8, 448.0),
    "mxfp8-e5m2": (5, 2, 15, 57344.0),
    "mxfp6": (2, 3, 2, 7.5),
    "mxfp6-e3m2": (3, 2, 4, 28.0),
    "mxfp4": (2, 1, 2, 6.0),
}


def _positive_codes(exp_bits: int, man_bits: int, top: float) -> list[tuple[int, float]]:
    """(code, value) of every non-negative finite element up to the largest normal."""
    bias = 2 ** (exp_bits - 1) - 1
    out = []
    for code in range(2 ** (exp_bits + man_bits)):
        e, m = code >> man_bits, code % 2**man_bits
        if e == 0:
            value = 2.0 ** (1 - bias) * m / 2**man_bits
        else:
            value = 2.0 ** (e - bias) * (1 + m / 2**man_bits)
        if value <= top:
            out.append((code, value))
    return out


def _nearest(q: float, table: list[tuple[int, float]]) -> int:
    """The code nearest to |q| (ties: the even code)."""
    best = min(table, key=lambda cv: (abs(abs(q) - cv[1]), cv[0] % 2))
    return best[0]


def _reference(x: list[float], name: str) -> tuple[list[int], list[int], list[float]]:
    """E8M0 scale codes, element codes and decoded values of one message, per the spec."""
    exp_bits, man_bits, emax, top = SPEC[name]
    table = _positive_codes(exp_bits, man_bits, top)
    values = dict(table)
    sign_bit = 1 << (exp_bits + man_bits)
    scales, codes, decoded = [], [], []
    for start in range(0, len(x), 32):
        block = x[start : start + 32]
        amax = max(abs(v) for v in block)
        shared = math.frexp(amax)[1] - 1 - emax if amax > 0 else -127
        shared = max(-127, min(127, shared))
        scale = 2.0**shared
        scales.append(shared + 127)
        for v in block:
            q = max(-top, min(top, v / scale))
            code = _nearest(q, table)
            negative = math.copysign(1.0, v) < 0
            codes.append(code | (sign_bit if negative else 0))
            decoded.append(math.copysign(values[code], -1.0 if negative else 1.0) * scale)
    return scales, codes, decoded


def _unpack(data: bytes, bits: int, numel: int) -> list[int]:
    """Element codes from the documented packing: the first element in the low bits."""
    stream = int.from_bytes(bytes(data), "little")
    return [(stream >> (bits * i)) & (2**bits - 1) for i in range(numel)]


def _mx_data(name: str) -> torch.Tensor:
    """Blocks of wide and tiny data, an all-zero block, a block of the element's ties at
    scale 1, and a short last block."""
    exp_bits, man_bits, emax, top = SPEC[name]
    table = [v for _, v in _positive_codes(exp_bits, man_bits, top)]
    ties = [(a + b) / 2 for a, b in itertools.pairwise(table)]
    ties = ties[:: max(1, len(ties) // 31)][:31]  # spread over the range
    ties_block = [2.0**emax] + [t * (-1) ** i for i, t in enumerate(ties)]
    ties_block += [0.0] * (32 - len(ties_block))
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(64, generator=g) * torch.exp2(torch.randint(-20, 20, (64,), generator=g))
    tiny = torch.randn(32, generator=g) * 2.0**-135  # float32 subnormals: scale 2^-127
    return torch.cat(
        [wide, tiny, torch.zeros(32), torch.tensor(ties_block), torch.randn(5, generator=g)]
    ).float()


@pytest.mark.parametrize("name", list(SPEC))
def test_mx_formats_equal_the_spec_element_by_element(name):
    fmt = FORMATS[name]
    x = _mx_data(name)
    scales, codes, decoded = _reference(x.tolist(), name)
    sent_scales, data = fmt.encode(x)
    assert sent_scales.tolist() == scales
    bits = 1 + SPEC[name][0] + SPEC[name][1]
    assert _unpack(data.numpy().tobytes(), bits, x.numel()) == codes
    out = fmt.decode((sent_scales, data), x.numel())
    assert torch.equal(_bits(out), _bits(torch.tensor(decoded, dtype=torch.float32)))
    n = x.numel()
    packed = {8: n, 6: 3 * math.ceil(n / 4), 4: math.ceil(n / 2)}[bits]
    assert sent_scales.nbytes + data.nbytes == packed + math.ceil(n / 32) == fmt.wire_bytes(n)


@pytest.mark.parametrize("name", list(FORMATS))
def test_round_is_decode_of_encode_for_each_message_of_a_batch(name):
    fmt = FORMATS[name]
    messages = torch.stack([_data(seed, 77) for seed in range(3)]).clamp(-6e4, 6e4)
    rounded = fmt.round(messages)
    for row, out in zip(messages, rounded, strict=True):
        decoded = fmt.decode(fmt.encode(row), row.numel())
        assert torch.equal(_bits(out), _bits(decoded))
        assert sum(t.nbytes for t in fmt.encode(row)) == fmt.wire_bytes(row.numel())
    assert not torch.equal(rounded, messages) or name == "fp32"


def test_an_unknown_format_names_the_known_ones():
    with pytest.raises(UsageError, match=r"unknown number format 'fp7'.*bf16, fp16, fp8-e4m3"):
        wire_format("fp7")
