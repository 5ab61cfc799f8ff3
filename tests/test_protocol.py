"""The compressor protocol: the drivers know only it, a plain GRACE-style class
registered like a built-in replays as an independent error-feedback recursion says, and
the simulated communicator answers every collective as the plain arithmetic does."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import gradstat.compressors as compressors_package
from gradstat.analysis.replay import ReplayParams, replay
from gradstat.compressors import REGISTRY, Compressor, Entry, Memory, ResidualMemory
from gradstat.compressors.cost import Link
from gradstat.store import layer_table, open_capture, write_capture
from tests.reference_compressors import ef_topk

GRADSTAT = Path(compressors_package.__file__).resolve().parents[1]
COMPRESSORS = GRADSTAT / "compressors"


def _protocol_classes() -> set[str]:
    """Names of every class of gradstat.compressors that is a compressor or a memory
    (importing every module of the package)."""
    import importlib
    import pkgutil

    names = set()
    for info in pkgutil.iter_modules([str(COMPRESSORS)]):
        module = importlib.import_module(f"gradstat.compressors.{info.name}")
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, (Compressor, Memory)):
                names.add(name)
    return names


def test_no_driver_dispatches_on_compressor_classes():
    """No ``isinstance`` (or ``type(...) is``) on a compressor or memory class outside
    gradstat/compressors/: replay, recommend, report, the hooks, compare and the cost
    model call the protocol."""
    classes = _protocol_classes()
    assert {"TopK", "CLTK", "PowerSGD", "ResidualMemory", "DGCMemory"} <= classes
    found = []
    for path in GRADSTAT.rglob("*.py"):
        if COMPRESSORS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if named & classes:
                    found.append(f"{path.relative_to(GRADSTAT)}:{node.lineno}")
    assert found == []


class ThreeTensorTopK:
    """A user's GRACE-style top-k: ``k = max(1, int(d * ratio))``, a payload of three
    tensors (values, int64 indices, the count), no ``sparse``, no memory of its own."""

    def __init__(self, compress_ratio: float) -> None:
        self.ratio = compress_ratio

    def compress(self, tensor, name):
        k = max(1, int(tensor.numel() * self.ratio))
        indices = torch.topk(tensor.abs(), k).indices
        return [tensor[indices], indices, torch.tensor([k], dtype=torch.int32)], tensor.numel()

    def decompress(self, tensors, ctx):
        values, indices, _ = tensors
        out = torch.zeros(ctx)
        out[indices] = values
        return out


class Adapted(ThreeTensorTopK, Compressor):
    """The class on the protocol, as the registry builds it (k for the quality column)."""

    def __init__(self, ratio: float, k: int) -> None:
        super().__init__(ratio)
        self.k = k

    def memory(self) -> Memory:
        return ResidualMemory()


def test_a_plain_grace_class_in_the_registry_replays_as_error_feedback(tmp_path, monkeypatch):
    """Registered like a built-in (one Entry), a three-tensor sparse payload replays:
    bytes are its tensors' sizes, elements sent and build-up its decompressed non-zeros,
    error and memory those of the numpy recursion (the issue's ``too many values to
    unpack`` regression)."""
    rng = np.random.default_rng(4)
    grads = rng.laplace(size=(3, 4, 900)).astype(np.float32)
    path = write_capture(tmp_path / "cap", grads, layer_table([("w", (30, 30))]))
    entry = Entry(lambda ctx: Adapted(ctx.ratio, ctx.k), False, "a user's top-k")
    monkeypatch.setitem(REGISTRY, "three-tensor-topk", entry)
    with open_capture(path) as cap:
        params = ReplayParams("three-tensor-topk", (0.02,), Link(1.25e9, 5e-6))
        records = replay(cap, params=params).to_dict("records")
    for got, want in zip(records, ef_topk(grads, 0.02), strict=True):
        assert got["density"] == want["k"] / 900
        assert got["union"] == want["union"]
        # int64 index + float32 value per element, and the int32 count
        assert got["bytes_per_learner"] == 12 * want["k"] + 4
        assert got["rel_error"] == pytest.approx(want["rel_error"], rel=1e-5)
        assert got["memory_norm"] == pytest.approx(want["memory_norm"], rel=1e-5)


def _exchange(learner: int, n: int):
    """An exchange that makes every collective once, with known answers."""
    from gradstat.compressors.exchange import AllGather, AllReduce, Broadcast, Round, Sent, Shared

    summed = yield AllReduce(
        [torch.full((3,), float(learner + 1)), torch.ones(2, dtype=torch.float16)]
    )
    gathered = yield AllGather([torch.arange(learner + 1, dtype=torch.float32)])
    root = yield Broadcast(torch.tensor([learner * 10]), 1)
    sends = {(learner + 1) % n: [torch.tensor([learner])]}
    receives = {(learner - 1) % n: [((1,), torch.int64)]}
    got = yield Round(sends, receives)
    shared = yield Shared(_count, (gathered,))
    info = {"from": float(got[(learner - 1) % n][0][0]), "root": float(root[0])}
    return Sent(None, summed[0], (), 0, info={**info, "shared": shared}, payload=summed)


CALLS: list[int] = []


def _count(gathered) -> float:
    CALLS.append(1)
    return float(sum(len(g[0]) for g in gathered))


def test_the_simulated_communicator_answers_collectives_as_plain_arithmetic():
    """All-reduce: the float32 sum in learner order (16-bit payloads summed in float32);
    all-gather: every learner's tensors in order; broadcast: the root's; a round of
    point-to-point messages: each peer's; shared work: computed once for everyone."""
    from gradstat.compressors.exchange import advance
    from gradstat.compressors.simulated import lockstep

    n = 4
    CALLS.clear()
    exchanges = [_exchange(i, n) for i in range(n)]
    ops = [advance(e, None)[0] for e in exchanges]
    results = lockstep(exchanges, ops)
    for i, result in enumerate(results):
        assert torch.equal(result.estimate, torch.full((3,), 10.0))  # 1 + 2 + 3 + 4
        assert result.payload[1].dtype == torch.float32 and result.payload[1].tolist() == [4, 4]
        assert result.info == {"from": float((i - 1) % n), "root": 10.0, "shared": 10.0}
    assert CALLS == [1]  # once, not once per learner


def test_learners_that_disagree_are_an_error_not_a_hang():
    from gradstat.compressors.exchange import AllGather, AllReduce
    from gradstat.compressors.simulated import lockstep

    def one(kind):
        yield kind([torch.ones(1)])

    exchanges = [one(AllReduce), one(AllGather)]
    ops = [next(e) for e in exchanges]
    with pytest.raises(RuntimeError, match="disagree on the collective"):
        lockstep(exchanges, ops)
