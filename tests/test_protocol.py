"""The compressor protocol: the drivers know only it, a plain GRACE-style class
registered like a built-in replays as an independent error-feedback recursion says, and
the training forms run against the simulated communicator replay as the streams do."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import gradstat.compressors as compressors_package
from gradstat.analysis.replay import ReplayParams, replay
from gradstat.compressors import REGISTRY, Compressor, Entry, Memory, Stream
from gradstat.compressors.cost import Link
from gradstat.store import Scope, layer_table, open_capture, write_capture
from tests.reference_compressors import ef_topk

GRADSTAT = Path(compressors_package.__file__).resolve().parents[1]
COMPRESSORS = GRADSTAT / "compressors"


def _protocol_classes() -> set[str]:
    """Names of every class of gradstat.compressors that is a compressor, a memory or a
    stream (importing every module of the package)."""
    import importlib
    import pkgutil

    names = set()
    for info in pkgutil.iter_modules([str(COMPRESSORS)]):
        module = importlib.import_module(f"gradstat.compressors.{info.name}")
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, (Compressor, Memory, Stream)):
                names.add(name)
    return names


def test_no_driver_dispatches_on_compressor_classes():
    """No ``isinstance`` (or ``type(...) is``) on a compressor, memory or stream class
    outside gradstat/compressors/: replay, recommend, report, the hooks, compare and the
    cost model call the protocol."""
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


@pytest.mark.parametrize(
    "name", ["clt-k", "clt-k:beta=0.5", "gtopk", "powersgd:rank=2", "randomk", "threshold"]
)
def test_online_forms_against_a_simulated_communicator_equal_the_streams(tmp_path, name):
    """Every learner's ``online`` step (the DDP hook's form) run in threads against the
    simulated communicator replays as the compressor's own streamed form: the same
    aggregate, elements sent, bytes and memory norm, step after step."""
    from gradstat.analysis.replay import scope_shapes
    from gradstat.analysis.selection import k_for
    from gradstat.compressors import build_scheme, parse_compressors
    from gradstat.compressors.memory import TensorRows
    from gradstat.compressors.simulated import OnlineStream

    rng = np.random.default_rng(9)
    layers = layer_table([("w", (40, 30)), ("b", (30,))])
    grads = torch.from_numpy(rng.laplace(size=(5, 3, 1230)).astype(np.float32))
    (spec,) = parse_compressors(name)
    ratio = None if spec.fixed_rate else 0.02
    k = None if ratio is None else k_for(ratio, 1230)
    shapes = scope_shapes(layers, Scope("model", ((0, 1230),)))
    own, simulated = (
        build_scheme(spec, ratio, k, numel=1230, shapes=shapes, seed=3) for _ in range(2)
    )
    simulated.memory.allocate(3, 1230, TensorRows)
    stream = OnlineStream(simulated, "model", 3, 1230)
    for g in grads:
        want = own.step(g)
        stream.begin(lambda i, g=g: g[i])
        for i in range(3):
            stream.learner(i, g[i])
        got = stream.finish()
        expected = want.estimate.dense() if hasattr(want.estimate, "dense") else want.estimate
        torch.testing.assert_close(got.estimate, expected, rtol=1e-5, atol=1e-6)
        assert got.selected == want.selected
        assert [t.nbytes for t in got.transfers] == [t.nbytes for t in want.transfers]
        assert got.memory_norm == pytest.approx(want.memory_norm, rel=1e-5)
