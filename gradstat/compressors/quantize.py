"""Dense compressors: no compression, 16-bit casts, sign, QSGD and TernGrad.

Their rate is fixed by the encoding, so replay runs them once, not once per ratio.
Payload bytes are those of the tensors that would be sent:

* ``none``: float32 values, ring all-reduce.
* ``fp16`` / ``bf16``: the cast values (2 bytes each), all-reduce.
* ``signsgd`` (Bernstein et al. 2018, majority vote) and ``ef-signsgd`` (Karimireddy et
  al. 2019, docs/methods.md 4): one bit per element packed into uint8 plus one float32
  scale ``||p||_1 / d``; all-gathered. signSGD aggregates by majority vote scaled by the
  learners' mean scale (so its error is comparable); EF-signSGD averages and keeps the
  residual in error-feedback memory.
* ``qsgd`` (Alistarh et al. 2017): per bucket of ``bucket`` elements one float32 norm and
  per element a signed level in ``[-s, s]`` rounded stochastically (unbiased), sent as
  int8 (int16 when ``s > 127``, as GRACE does); all-gathered.
* ``terngrad`` (Wen et al. 2017): ``s = max |p|``, each element ``s * sign * b`` with
  ``b ~ Bernoulli(|p| / s)`` (unbiased); 2-bit codes packed four per byte plus one float32
  ``s``; all-gathered. (The paper's optional gradient clipping is not applied.)
"""

from __future__ import annotations

import torch

from gradstat.compressors.legacy import LocalCompressor, Payload, pack_bits, unpack_bits


class NoCompression(LocalCompressor):
    """The dense float32 all-reduce every compressor is judged against."""

    name = "none"
    collective = "allreduce"

    def compress(self, tensor: torch.Tensor, learner: int = 0) -> Payload:
        return Payload((tensor,), tensor.numel(), tensor.numel())

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors[0]


class Cast(LocalCompressor):
    """A cast to a 16-bit float type before a dense all-reduce."""

    collective = "allreduce"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def compress(self, tensor: torch.Tensor, learner: int = 0) -> Payload:
        return Payload((tensor.to(self.dtype),), tensor.numel(), tensor.numel())

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors[0].float()


class SignSGD(LocalCompressor):
    """Sign bits plus the scale ``||p||_1 / d``; ``majority`` selects signSGD's vote."""

    collective = "allgather"

    def __init__(self, majority: bool) -> None:
        self.majority = majority
        self.name = "signsgd" if majority else "ef-signsgd"

    def compress(self, tensor: torch.Tensor, learner: int = 0) -> Payload:
        scale = tensor.abs().mean().reshape(1)
        bits = pack_bits((tensor >= 0).to(torch.int32), 1)
        return Payload((bits, scale), tensor.numel(), tensor.numel())

    def decompress(self, payload: Payload) -> torch.Tensor:
        bits, scale = payload.tensors
        signs = unpack_bits(bits, 1, payload.numel).to(scale.dtype) * 2 - 1
        return signs * scale

    def aggregate(self, sent: torch.Tensor) -> torch.Tensor:
        """Majority vote scaled by the mean scale (signSGD) or the mean (EF-signSGD)."""
        if not self.majority:
            return sent.mean(dim=0)
        scale = sent.abs().mean(dim=1).mean()
        return torch.sign(torch.sign(sent).sum(dim=0)) * scale


class QSGD(LocalCompressor):
    """QSGD with ``levels`` s and buckets of ``bucket`` elements (stochastic, unbiased)."""

    name = "qsgd"
    collective = "allgather"

    def __init__(self, levels: int = 127, bucket: int = 512, seed: int = 0) -> None:
        if not 1 <= levels <= 32767:
            raise ValueError(f"qsgd levels must be in 1..32767, got {levels}")
        if bucket < 1:
            raise ValueError(f"qsgd bucket must be positive, got {bucket}")
        self.levels = levels
        self.bucket = bucket
        self.level_dtype = torch.int8 if levels <= 127 else torch.int16
        self.generator = torch.Generator().manual_seed(seed)

    def compress(self, tensor: torch.Tensor, learner: int = 0) -> Payload:
        d = tensor.numel()
        padded = torch.nn.functional.pad(tensor, (0, (-d) % self.bucket)).view(-1, self.bucket)
        norms = torch.linalg.vector_norm(padded, dim=1, keepdim=True)
        scaled = padded.abs() / norms.clamp_min(torch.finfo(tensor.dtype).tiny) * self.levels
        noise = torch.rand(scaled.shape, generator=self.generator, dtype=tensor.dtype)
        level = torch.floor(scaled + noise).clamp_max(self.levels) * torch.sign(padded)
        return Payload((level.view(-1)[:d].to(self.level_dtype), norms.view(-1)), d, d)

    def decompress(self, payload: Payload) -> torch.Tensor:
        level, norms = payload.tensors
        d = payload.numel
        padded = torch.nn.functional.pad(level.to(norms.dtype), (0, (-d) % self.bucket))
        values = padded.view(-1, self.bucket) * norms.unsqueeze(1) / self.levels
        return values.view(-1)[:d]

    def settings(self) -> dict[str, float]:
        return {"levels": self.levels, "bucket": self.bucket}


class TernGrad(LocalCompressor):
    """TernGrad: ``s * sign(p) * Bernoulli(|p| / s)`` with ``s = max |p|``, 2 bits each."""

    name = "terngrad"
    collective = "allgather"

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def compress(self, tensor: torch.Tensor, learner: int = 0) -> Payload:
        scale = tensor.abs().max().reshape(1)
        prob = tensor.abs() / scale.clamp_min(torch.finfo(tensor.dtype).tiny)
        keep = torch.rand(tensor.shape, generator=self.generator, dtype=tensor.dtype) < prob
        codes = (torch.sign(tensor) * keep).to(torch.int32) + 1
        return Payload((pack_bits(codes, 2), scale), tensor.numel(), tensor.numel())

    def decompress(self, payload: Payload) -> torch.Tensor:
        packed, scale = payload.tensors
        codes = unpack_bits(packed, 2, payload.numel)
        return (codes - 1).to(scale.dtype) * scale
