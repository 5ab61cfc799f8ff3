"""Users' compressors the tests train and replay with (tests/test_hooks.py,
tests/test_user_compressors.py): GRACE-shaped, importing nothing of gradstat."""

import os

import torch


class InPlaceTopK:
    """Top-k whose ``aggregate`` adds into its first argument, as many users write it:
    handed the learners' own vectors it would change what one of them sent."""

    def __init__(self, compress_ratio):
        self.compress_ratio = compress_ratio

    def compress(self, tensor, name):
        flat = tensor.flatten()
        k = max(1, int(flat.numel() * self.compress_ratio))
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        return [indices.to(torch.int32), flat[indices]], (flat.numel(), tensor.shape)

    def decompress(self, tensors, ctx):
        indices, values = tensors
        numel, shape = ctx
        return torch.zeros(numel).index_put_((indices.long(),), values).view(shape)

    def aggregate(self, tensors):
        total = tensors[0]
        for tensor in tensors[1:]:
            total += tensor
        return total


class SlowTopK(InPlaceTopK):
    """The same top-k and payload, made slow on purpose (it sorts its vector 20 times
    first): priced on this machine it must cost more than the built-in's."""

    def compress(self, tensor, name):
        for _ in range(20):
            torch.sort(tensor.flatten().abs())
        return super().compress(tensor, name)


class Raises:
    """A compressor that fails at its second step."""

    def __init__(self):
        self.calls = 0

    def compress(self, tensor, name):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("out of luck")
        return [tensor.flatten()], tensor.shape

    def decompress(self, tensors, ctx):
        return tensors[0].view(ctx)


class Shapes:
    """Notes the name and shape of every tensor it is handed in the file $SHAPES_LOG (a
    dense payload)."""

    def compress(self, tensor, name):
        with open(os.environ["SHAPES_LOG"], "a") as log:
            log.write(f"{name} {list(tensor.shape)}\n")
        return [tensor.flatten()], tensor.shape

    def decompress(self, tensors, ctx):
        return tensors[0].view(ctx)
