"""The user's own compressors (MODULE:CLASS, FILE.py:CLASS, entry points, GRACE classes)
against a plain error-feedback recursion, and their mistakes as one named line."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from gradstat.store import open_capture
from tests.helpers import assert_clean_error, run_cli
from tests.reference_compressors import ef_topk

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "compressors.py"
RATIO = 0.05


def quantized(g: np.ndarray, bits: int, seed: int, step: int, learner: int) -> np.ndarray:
    """The example's stochastic quantizer on one learner's row (the one message of the
    model), decoded: its uniform draws come from torch's generator seeded from numpy's
    SeedSequence([seed, step, learner + 1, message]) (gradstat's contract for a user's
    random draws: the first 64-bit word, halved, modulo 2^32)."""
    levels = 2 ** (bits - 1) - 1
    word = np.random.SeedSequence([seed, step, learner + 1, 0]).generate_state(1, np.uint64)[0]
    torch.manual_seed(int(word >> 1) % 2**32)
    noise = torch.rand(g.size).numpy()
    scale = np.float32(np.abs(g).max() / np.float32(levels))
    low = np.floor(g / scale)
    return ((low + (noise < g / scale - low)) * scale).astype(np.float32)


def quantize_reference(grads: np.ndarray, bits: int, seed: int = 0) -> list[float]:
    """Per step, the relative error of the mean of the quantized rows (no memory)."""
    n, steps, _ = grads.shape
    out = []
    for s in range(steps):
        decoded = np.stack([quantized(grads[i, s], bits, seed, s, i) for i in range(n)])
        mean = grads[:, s].astype(np.float64).mean(axis=0)
        estimate = decoded.astype(np.float64).mean(axis=0)
        out.append(float(((estimate - mean) ** 2).sum() / (mean**2).sum()))
    return out


def replay_records(capsys, capture, compressors: str, *extra: str) -> list[dict]:
    result = run_cli(
        capsys, "replay", capture, "--compressors", compressors, "--ratios", str(RATIO), "--json",
        *extra,
    )  # fmt: skip
    assert result.code == 0, result.stderr
    return json.loads(result.stdout)["records"]


def assert_matches_reference(
    records: list[dict], grads: np.ndarray, own_memory=False, feedback=True
) -> None:
    reference = ef_topk(grads, RATIO, feedback)
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    d = grads.shape[2]
    for record, expected in zip(records, reference, strict=True):
        assert record["bytes_per_learner"] == 12 * expected["k"]  # int64 index + float32
        assert record["density"] == pytest.approx(expected["k"] / d)
        assert record["rel_error"] == pytest.approx(expected["rel_error"], rel=1e-5)
        assert record["union"] == expected["union"]
        if own_memory:  # a GRACE memory's norm is not known to gradstat
            assert record["memory_norm"] is None  # NaN: null in --json
        else:
            assert record["memory_norm"] == pytest.approx(expected["memory_norm"], rel=1e-5)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --- a file, a module, an entry point, GRACE's classes ------------------------------------


def test_file_compressor_replays_as_the_error_feedback_recursion(synthetic_capture, capsys):
    path, grads = synthetic_capture
    records = replay_records(capsys, path, f"{EXAMPLE}:TopK+residual", "--jobs", "1")
    assert {r["compressor"] for r in records} == {f"{EXAMPLE}:TopK+residual"}
    assert_matches_reference(records, grads)


def test_module_compressor_from_the_working_directory_in_worker_processes(
    synthetic_capture, capsys, tmp_path, monkeypatch
):
    path, grads = synthetic_capture
    write(tmp_path / "work" / "mine.py", EXAMPLE.read_text())
    monkeypatch.chdir(tmp_path / "work")
    specs = "mine:TopK+residual,mine:Quantize:bits=6"
    one = replay_records(capsys, path, specs, "--jobs", "1")
    two = replay_records(capsys, path, specs, "--jobs", "2")
    drop = ("compress_seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in one] == [
        {k: v for k, v in r.items() if k not in drop} for r in two
    ]
    assert_matches_reference([r for r in one if r["compressor"] == "mine:TopK+residual"], grads)
    quantized = [r for r in one if r["compressor"] == "mine:Quantize:bits=6"]
    d = grads.shape[2]
    assert {r["bytes_per_learner"] for r in quantized} == {d + 4}  # int8 codes, one scale
    for record, expected in zip(quantized, quantize_reference(grads, bits=6), strict=True):
        assert record["rel_error"] == pytest.approx(expected, rel=1e-5)


def test_recommend_ranks_it_among_the_built_ins(synthetic_capture, capsys):
    path, _ = synthetic_capture
    mine = f"{EXAMPLE}:TopK+residual"
    result = run_cli(
        capsys, "recommend", path, "--error-budget", "0.9", "--compressors", f"{mine},topk",
        "--ratios", "0.1,0.05", "--jobs", "1", "--json",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    ranking = json.loads(result.stdout)["candidates"]
    rows = {(r["compressor"], r["ratio"]): r for r in ranking}
    assert set(rows) == {(c, r) for c in (mine, "topk") for r in (0.1, 0.05)}
    for ratio in (0.1, 0.05):
        ours, builtin = rows[mine, ratio], rows["topk", ratio]
        assert ours["rel_error"] == pytest.approx(builtin["rel_error"], rel=1e-6)
        assert ours["bytes_per_learner"] == 1.5 * builtin["bytes_per_learner"]  # int64 indices
        assert ours["within_budget"] and ours["seconds"] > 0


def test_ratio_and_seed_reach_the_constructor_by_name(synthetic_capture, capsys, tmp_path):
    """A constructor taking ``ratio`` (not GRACE's ``compress_ratio``) gets each density
    of --ratios; one taking ``seed`` gets --seed; its own text parameter arrives too."""
    path, grads = synthetic_capture
    mine = write(
        tmp_path / "named.py",
        """
        import torch


        class TopK:
            def __init__(self, ratio, seed, mode="magnitude"):
                if seed != 5 or mode != "fast":
                    raise ValueError(f"seed {seed}, mode {mode}")
                self.ratio = ratio

            def compress(self, tensor, name):
                k = max(1, int(tensor.numel() * self.ratio))
                _, indices = torch.topk(tensor.abs(), k)
                return [indices, tensor[indices]], tensor.numel()

            def decompress(self, tensors, ctx):
                indices, values = tensors
                return torch.zeros(ctx).index_put_((indices,), values)
        """,
    )
    spec = f"{mine}:TopK:mode=fast+residual"
    records = replay_records(capsys, path, spec, "--jobs", "1", "--seed", "5")
    assert {r["compressor"] for r in records} == {spec}
    assert_matches_reference(records, grads)


def test_without_a_memory_a_class_runs_as_grace_runs_it(synthetic_capture, capsys, tmp_path):
    """A class that names no memory runs without error feedback (GRACE's default);
    ``+residual`` adds it, ``+none`` keeps it off for a class that brings one; a
    function is accepted wherever a class is, for the compressor and the memory."""
    path, grads = synthetic_capture
    mine = write(
        tmp_path / "made.py",
        f"""
        import importlib.util

        spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE)!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)


        def topk(compress_ratio):
            return example.TopK(compress_ratio)


        class Residual:
            def __init__(self):
                self.residuals = {{}}

            def compensate(self, tensor, name):
                return tensor + self.residuals.get(name, 0.0)

            def update(self, tensor, name, compressor, tensors, ctx):
                self.residuals[name] = tensor - compressor.decompress(tensors, ctx)


        def residual():
            return Residual()


        class KeepsOne(example.TopK):
            memory = Residual
        """,
    )
    specs = [f"{EXAMPLE}:TopK", f"{mine}:topk+{mine}:residual", f"{mine}:KeepsOne+none"]
    records = replay_records(capsys, path, ",".join(specs), "--jobs", "1")
    by = {spec: [r for r in records if r["compressor"] == spec] for spec in specs}
    assert_matches_reference(by[specs[0]], grads, feedback=False)
    assert_matches_reference(by[specs[1]], grads, own_memory=True)
    assert_matches_reference(by[specs[2]], grads, feedback=False)


def test_an_entry_point_with_a_built_ins_name_is_refused(capsys, tmp_path, monkeypatch):
    site = tmp_path / "site"
    write(site / "shadow.py", EXAMPLE.read_text())
    info = site / "shadow-0.1.dist-info"
    write(info / "METADATA", "Metadata-Version: 2.1\nName: shadow\nVersion: 0.1\n")
    write(info / "entry_points.txt", "[gradstat.compressors]\ntopk = shadow:TopK\n")
    monkeypatch.syspath_prepend(str(site))
    result = run_cli(capsys, "replay", tmp_path / "nothing", "--compressors", "topk")
    assert_clean_error(result, 2)
    assert "entry point 'topk' (shadow:TopK)" in result.stderr
    assert "rename it" in result.stderr


def test_random_draws_follow_the_seed(synthetic_capture, capsys):
    path, _ = synthetic_capture
    spec = f"{EXAMPLE}:Quantize:bits=2"
    first = replay_records(capsys, path, spec, "--jobs", "1", "--seed", "3")
    again = replay_records(capsys, path, spec, "--jobs", "1", "--seed", "3")
    other = replay_records(capsys, path, spec, "--jobs", "1", "--seed", "4")
    errors = [[r["rel_error"] for r in run] for run in (first, again, other)]
    assert errors[0] == errors[1]
    assert errors[0] != errors[2]


GRACE_BASE = '''
    """A stand-in for grace_dl.torch: GRACE's abstract Memory, Compressor, Communicator."""
    from abc import ABC, abstractmethod


    class Memory(ABC):
        @abstractmethod
        def compensate(self, tensor, name):
            raise NotImplementedError

        def update(self, tensor, name, compressor, tensor_compressed, ctx):
            pass


    class Compressor(ABC):
        def __init__(self, average=True, tensors_size_are_same=True):
            self.average = average
            self.tensors_size_are_same = tensors_size_are_same

        @abstractmethod
        def compress(self, tensor, name):
            raise NotImplementedError

        @abstractmethod
        def decompress(self, tensors, ctx):
            raise NotImplementedError

        def aggregate(self, tensors):
            return sum(tensors)
'''
GRACE_TOPK = """
    import torch

    from grace_dl.torch import Compressor


    class TopKCompressor(Compressor):
        def __init__(self, compress_ratio):
            super().__init__()
            self.compress_ratio = compress_ratio

        def compress(self, tensor, name):
            flat = tensor.flatten()
            k = max(1, int(flat.numel() * self.compress_ratio))
            _, indices = torch.topk(flat.abs(), k, sorted=False)
            return (torch.gather(flat, 0, indices), indices), (flat.numel(), tensor.size())

        def decompress(self, tensors, ctx):
            values, indices = tensors
            numel, shape = ctx
            out = torch.zeros(numel, dtype=values.dtype)
            out.scatter_(0, indices, values)
            return out.view(shape)
"""
GRACE_SIGNSGD = """
    import torch

    from grace_dl.torch import Compressor


    class SignSGDCompressor(Compressor):
        def __init__(self):
            super().__init__(average=False)

        def compress(self, tensor, name):
            return [(tensor.flatten() >= 0).type(torch.uint8)], tensor.size()

        def decompress(self, tensors, shape):
            (signs,) = tensors
            return (signs.type(torch.float32) * 2 - 1).view(shape)

        def aggregate(self, tensors):
            return (sum(tensors) >= 0) * 2.0 - 1.0
"""
GRACE_RESIDUAL = """
    from grace_dl.torch import Memory


    class ResidualMemory(Memory):
        def __init__(self, beta=1.0, gamma=1.0):
            self.residuals = {}
            self.beta = beta
            self.gamma = gamma

        def compensate(self, tensor, name):
            if name in self.residuals:
                tensor = self.beta * self.residuals[name] + self.gamma * tensor
            return tensor

        def update(self, tensor, name, compressor, tensor_compressed, ctx):
            self.residuals[name] = tensor - compressor.decompress(tensor_compressed, ctx)
"""


GRACE_RANDOMK = """
    import torch

    from grace_dl.torch import Compressor


    def sparsify(tensor, compress_ratio):
        tensor = tensor.flatten()
        numel = tensor.numel()
        k = max(1, int(numel * compress_ratio))
        indices = torch.randperm(numel, device=tensor.device)[:k]
        return indices, tensor[indices]


    class RandomKCompressor(Compressor):
        def __init__(self, compress_ratio):
            super().__init__()
            self.global_step = 0
            self.compress_ratio = compress_ratio

        def compress(self, tensor, name):
            h = sum(bytes(name, encoding="utf8"), self.global_step)
            self.global_step += 1
            torch.manual_seed(h)
            indices, values = sparsify(tensor, self.compress_ratio)
            return [values], (indices, tensor.numel(), tensor.size())

        def decompress(self, tensors, ctx):
            indices, numel, shape = ctx
            (values,) = tensors
            out = torch.zeros(numel, dtype=values.dtype)
            out.scatter_(0, indices, values)
            return out.view(shape)
"""
GRACE_THRESHOLD = """
    import torch

    from grace_dl.torch import Compressor


    class ThresholdCompressor(Compressor):
        def __init__(self, threshold):
            super().__init__(tensors_size_are_same=False)
            self.threshold = threshold

        def compress(self, tensor, name):
            shape = tensor.size()
            tensor = tensor.flatten()
            (indices,) = torch.where(tensor.abs() >= self.threshold)
            return [tensor[indices], indices], (shape, tensor.numel())

        def decompress(self, tensors, ctx):
            shape, numel = ctx
            values, indices = tensors
            out = torch.zeros(numel, dtype=values.dtype)
            out.scatter_(0, indices, values)
            return out.view(shape)
"""
GRACE_NONE = """
    from grace_dl.torch import Memory


    class NoneMemory(Memory):
        def compensate(self, tensor, name):
            return tensor

        def update(self, tensor, name, compressor, tensor_compressed, ctx):
            pass
"""


@pytest.fixture
def grace(tmp_path, monkeypatch):
    """A small ``grace_dl`` on the import path with GRACE's API (its top-k and residual
    memory), and a user's file composing them."""
    site = tmp_path / "site"
    write(site / "grace_dl" / "__init__.py", "")
    write(site / "grace_dl" / "torch" / "__init__.py", GRACE_BASE)
    write(site / "grace_dl" / "torch" / "compressor" / "__init__.py", "")
    write(site / "grace_dl" / "torch" / "compressor" / "topk.py", GRACE_TOPK)
    write(site / "grace_dl" / "torch" / "compressor" / "signsgd.py", GRACE_SIGNSGD)
    write(site / "grace_dl" / "torch" / "memory" / "__init__.py", "")
    write(site / "grace_dl" / "torch" / "memory" / "residual.py", GRACE_RESIDUAL)
    write(site / "grace_dl" / "torch" / "memory" / "none.py", GRACE_NONE)
    write(site / "grace_dl" / "torch" / "compressor" / "randomk.py", GRACE_RANDOMK)
    write(site / "grace_dl" / "torch" / "compressor" / "threshold.py", GRACE_THRESHOLD)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", f"{site}:{ROOT}")
    mine = write(
        tmp_path / "mine.py",
        """
        from grace_dl.torch.compressor.topk import TopKCompressor
        from grace_dl.torch.memory.residual import ResidualMemory


        class TopKWithGraceMemory(TopKCompressor):
            memory = ResidualMemory
        """,
    )
    return mine


def test_grace_classes_run_unchanged(synthetic_capture, capsys, grace):
    path, grads = synthetic_capture
    specs = f"grace_dl.torch.compressor.topk:TopKCompressor+residual,{grace}:TopKWithGraceMemory"
    records = replay_records(capsys, path, specs, "--jobs", "1")
    plain, with_memory = specs.split(",")
    assert_matches_reference([r for r in records if r["compressor"] == plain], grads)
    mine = [r for r in records if r["compressor"] == with_memory]
    assert_matches_reference(mine, grads, own_memory=True)


def test_grace_aggregate_and_average_are_used(synthetic_capture, capsys, grace):
    """GRACE's signSGD (``average=False``, a majority-vote ``aggregate``) with gradstat's
    residual memory, against the recursion in numpy."""
    path, grads = synthetic_capture
    spec = "grace_dl.torch.compressor.signsgd:SignSGDCompressor+residual"
    records = replay_records(capsys, path, spec, "--jobs", "1")
    n, steps, d = grads.shape
    memory = np.zeros((n, d), dtype=np.float32)
    for s, record in zip(range(steps), records, strict=True):
        p = grads[:, s] + memory
        sent = np.where(p >= 0, 1.0, -1.0).astype(np.float32)
        memory = p - sent
        vote = np.where(sent.sum(axis=0) >= 0, 1.0, -1.0)
        mean = grads[:, s].astype(np.float64).mean(axis=0)
        rel = ((vote - mean) ** 2).sum() / (mean**2).sum()
        assert record["rel_error"] == pytest.approx(rel, rel=1e-6)
        assert record["bytes_per_learner"] == d  # one uint8 per element


def _grace_tensor_recursion(grads, layers, compressor, memory):
    """A plain per-tensor recursion of GRACE's classes, one object each per learner and
    tensor (``compressor(name)``, ``memory()``): per step the records' model totals."""
    import torch as t

    n, steps, _ = grads.shape
    objects = {(i, layer.name): (compressor(), memory()) for i in range(n) for layer in layers}
    out = []
    for s in range(steps):
        estimate = np.zeros(grads.shape[2])
        sizes, selected, union = 0.0, 0, 0
        for layer in layers:
            cols = slice(layer.offset, layer.offset + layer.numel)
            sent, held = [], set()
            for i in range(n):
                c, m = objects[i, layer.name]
                g = t.from_numpy(grads[i, s, cols].copy()).view(layer.shape)
                p = m.compensate(g, layer.name)
                tensors, ctx = c.compress(p, layer.name)
                m.update(p, layer.name, c, tensors, ctx)
                decoded = c.decompress(tensors, ctx).flatten().numpy()
                sent.append(decoded)
                sizes += sum(x.numel() * x.element_size() for x in tensors) / n
                selected += max(x.numel() for x in tensors)
                held |= set(np.flatnonzero(decoded).tolist())
            estimate[cols] = np.mean(sent, axis=0)
            union += len(held)
        mean = grads[:, s].astype(np.float64).mean(axis=0)
        rel = float(((estimate - mean) ** 2).sum() / (mean**2).sum())
        out.append({"bytes": sizes, "selected": selected / n, "union": union, "rel_error": rel})
    return out


def test_grace_classes_with_their_memories_run_per_tensor(synthetic_capture, capsys, grace):
    """GRACE's random-k with GRACE's residual memory, its threshold with its NoneMemory,
    both named in the spec, at --granularity tensor: the records are the plain
    per-tensor recursion's; density and build-up are counted from the payloads (random-k:
    quality 1, build-up 1; threshold: the share it sent, not 1.0)."""
    import importlib

    path, grads = synthetic_capture
    with open_capture(path) as cap:
        layers = cap.layers
    memory, compressor = "grace_dl.torch.memory", "grace_dl.torch.compressor"
    specs = {
        "randomk": f"{compressor}.randomk:RandomKCompressor"
        f"+{memory}.residual:ResidualMemory:beta=0.9",
        "threshold": f"{compressor}.threshold:ThresholdCompressor:threshold=1.5"
        f"+{memory}.none:NoneMemory",
    }
    records = replay_records(capsys, path, ",".join(specs.values()), "--granularity", "tensor")
    residual = importlib.import_module(f"{memory}.residual").ResidualMemory
    none = importlib.import_module(f"{memory}.none").NoneMemory
    randomk = importlib.import_module("grace_dl.torch.compressor.randomk").RandomKCompressor
    threshold = importlib.import_module("grace_dl.torch.compressor.threshold").ThresholdCompressor
    plain = {
        "randomk": _grace_tensor_recursion(
            grads, layers, lambda: randomk(RATIO), lambda: residual(beta=0.9)
        ),
        "threshold": _grace_tensor_recursion(grads, layers, lambda: threshold(1.5), none),
    }
    d = grads.shape[2]
    for key, spec in specs.items():
        mine = [r for r in records if r["compressor"] == spec]
        assert {r["granularity"] for r in mine} == {"tensor"}
        for record, want in zip(mine, plain[key], strict=True):
            assert record["bytes_per_learner"] == pytest.approx(want["bytes"])
            assert record["density"] == pytest.approx(want["selected"] / d)
            assert record["rel_error"] == pytest.approx(want["rel_error"], rel=1e-5)
            assert record["union"] == want["union"]
    randomk_records = [r for r in records if r["compressor"] == specs["randomk"]]
    assert {r["quality"] for r in randomk_records} == {1.0}
    assert {r["buildup"] for r in randomk_records} == {1.0}
    sent_share = [r["density"] for r in records if r["compressor"] == specs["threshold"]]
    assert all(0 < share < 0.5 for share in sent_share)


def test_every_compressor_receives_each_tensor_in_its_shape(
    synthetic_capture, capsys, tmp_path, monkeypatch
):
    path, _ = synthetic_capture
    monkeypatch.setenv("SHAPES_LOG", str(tmp_path / "shapes"))
    spec = f"{ROOT / 'tests' / 'user_classes.py'}:Shapes"
    replay_records(capsys, path, spec, "--granularity", "tensor", "--steps", "0:1")
    with open_capture(path) as cap:
        expected = {f"{layer.name} {list(layer.shape)}" for layer in cap.layers}
    assert set((tmp_path / "shapes").read_text().splitlines()) == expected


def test_a_window_of_steps_draws_what_the_whole_replay_draws(synthetic_capture, capsys):
    """Random draws follow (seed, recorded step, learner, message): --steps 3:6 gives
    the numbers of steps 3-5 of a replay of every step (no memory carries anything)."""
    path, _ = synthetic_capture
    spec = f"{EXAMPLE}:Quantize:bits=2,qsgd,terngrad"
    whole = replay_records(capsys, path, spec)
    window = replay_records(capsys, path, spec, "--steps", "3:6")
    drop = ("compress_seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in window] == [
        {k: v for k, v in r.items() if k not in drop} for r in whole if r["step"] >= 3
    ]


def test_a_candidate_that_fails_is_one_warning_and_the_others_still_run(synthetic_capture, capsys):
    path, _ = synthetic_capture
    raises = f"{ROOT / 'tests' / 'user_classes.py'}:Raises"
    result = run_cli(
        capsys, "recommend", path, "--error-budget", "10", "--compressors", f"{raises},topk",
        "--ratios", "0.1", "--json",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
    said = " ".join(result.stderr.split())
    assert len(warnings) == 1 and "Raises left out" in said and "out of luck" in said
    candidates = json.loads(result.stdout)["candidates"]
    assert [c["compressor"] for c in candidates] == ["topk"]
    alone = run_cli(capsys, "recommend", path, "--error-budget", "10", "--compressors", raises)
    assert_clean_error(alone, 2)


def test_a_slow_class_is_priced_slower_than_the_built_in_with_its_payload(
    synthetic_capture, capsys
):
    """Prices are measured here: a class sending the built-in top-k's payload (int32
    indices, float32 values, k = max(1, round(...)) alike at ratio 0.1 here) but sorting
    its vector 20 times first costs more; a user's class is not priced by a count."""
    path, _ = synthetic_capture
    slow = f"{ROOT / 'tests' / 'user_classes.py'}:SlowTopK+residual"
    result = run_cli(
        capsys, "recommend", path, "--error-budget", "10", "--compressors", f"{slow},topk",
        "--ratios", "0.1", "--json",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = {c["compressor"]: c for c in doc["candidates"]}
    assert rows[slow]["bytes_per_learner"] == rows["topk"]["bytes_per_learner"]
    assert rows[slow]["compress_seconds"] > 2 * rows["topk"]["compress_seconds"]
    assert doc["priced"] == "measured"


def test_a_class_on_gradstats_protocol_runs_as_it_is(synthetic_capture, capsys, tmp_path):
    """A subclass of gradstat's Compressor that brings its own exchange (a method that
    needs every learner would): the replay drives it in lockstep, with the same records
    as the recursion."""
    path, grads = synthetic_capture
    top = f"{EXAMPLE}:TopK+residual"
    mine = write(
        tmp_path / "protocol.py",
        f"""
        import importlib.util

        from gradstat.compressors.base import Compressor
        from gradstat.compressors.memory import ResidualMemory

        spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE)!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)


        class ExchangeTopK(example.TopK, Compressor):
            inside = False

            def memory(self):
                return ResidualMemory()

            def exchange(self, p, call):
                self.inside = True
                try:
                    return (yield from super().exchange(p, call))
                finally:
                    self.inside = False

            def compress(self, tensor, name):
                assert self.inside, "compressed outside the exchange"
                return super().compress(tensor, name)
        """,
    )
    records = replay_records(capsys, path, f"{mine}:ExchangeTopK,{top}", "--jobs", "1")
    ours = [r for r in records if r["compressor"] == f"{mine}:ExchangeTopK"]
    assert_matches_reference(ours, grads)


def test_entry_points_are_listed_and_replay(synthetic_capture, capsys, tmp_path, monkeypatch):
    path, grads = synthetic_capture
    site = tmp_path / "site"
    write(site / "epkg.py", EXAMPLE.read_text())
    info = site / "epkg-0.1.dist-info"
    write(info / "METADATA", "Metadata-Version: 2.1\nName: epkg\nVersion: 0.1\n")
    write(info / "entry_points.txt", "[gradstat.compressors]\nepkg-topk = epkg:TopK\n")
    monkeypatch.syspath_prepend(str(site))
    listed = run_cli(capsys, "replay", "--compressors", "list")
    assert listed.code == 0
    assert "epkg-topk" in listed.stdout and "epkg:TopK" in listed.stdout
    assert "topk" in listed.stdout and "MODULE:CLASS" in listed.stdout
    assert_matches_reference(
        replay_records(capsys, path, "epkg-topk+residual", "--jobs", "1"), grads
    )


# --- their mistakes, named -------------------------------------------------------------

GOOD = """
import torch


class Mine:
    def __init__(self, compress_ratio):
        self.compress_ratio = compress_ratio

    def compress(self, tensor, name):
        k = max(1, int(tensor.numel() * self.compress_ratio))
        _, indices = torch.topk(tensor.abs(), k)
        return [indices, tensor[indices]], tensor.numel()

    def decompress(self, tensors, ctx):
        indices, values = tensors
        return torch.zeros(ctx).index_put_((indices,), values)
"""


def _broken(good: str, old: str, new: str) -> str:
    assert old in good
    return good.replace(old, new)


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


CASES = {
    # name: (file text or None, spec suffix, exit code, what the line must say, line of)
    "missing file": (None, "nothere.py:Mine", 2, "no such file", None),
    "syntax": (_broken(GOOD, "def compress(self", "def compress(self,,"), "", 2,
               "SyntaxError", "def compress"),
    "import raises": (_broken(GOOD, "import torch", "import torch\nSETUP = 1 / 0"), "", 2,
                      "does not import: ZeroDivisionError", "SETUP"),
    "missing dependency": (_broken(GOOD, "import torch", "import torch\nimport nosuchdep"), "",
                           2, "No module named 'nosuchdep'", "nosuchdep"),
    "no such module": (None, "nosuchmodule_xyz:Mine", 2, "no module named", None),
    # ":Top:" is also an emoji code, which must not be printed as one
    "no class named": (GOOD, "bad.py", 2, "name the class too, as bad.py:CLASS", None),
    "no class": (GOOD, "bad.py:Top", 2, "has no class 'Top' (it has: Mine)", None),
    "no compress": (_broken(GOOD, "def compress(", "def kompress("), "", 2,
                    "has no compress method", None),
    "unknown parameter": (GOOD, "bad.py:Mine:bits=3", 2, "no parameter 'bits'", None),
    "init raises": (_broken(GOOD, "self.compress_ratio = compress_ratio",
                            "raise RuntimeError('no GPU here')"), "", 1,
                    "__init__ raised RuntimeError: no GPU here", "no GPU here"),
    "compress raises": (_broken(GOOD, "k = max(", "k = 1 // 0 + max("), "", 1,
                        "compress raised ZeroDivisionError", "k = 1 // 0"),
    "compress returns one thing": (_broken(GOOD, "return [indices, tensor[indices]], "
                                           "tensor.numel()", "return indices"), "", 1,
                                   "compress returned int64[29]; return (tensors, ctx)",
                                   "def compress"),
    "decompress cannot read": (_broken(GOOD, "indices, values = tensors",
                                       "values, indices = tensors"), "", 1,
                               "decompress cannot read the payload (int64[29], float32[29])",
                               "index_put_"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_each_mistake_is_one_line_naming_spec_method_and_line(
    case, synthetic_capture, capsys, tmp_path, monkeypatch
):
    path, _ = synthetic_capture
    text, suffix, code, says, line_of = CASES[case]
    monkeypatch.chdir(tmp_path)
    if text is not None:
        write(tmp_path / "bad.py", text)
    spec = suffix or "bad.py:Mine"
    result = run_cli(
        capsys, "replay", path, "--compressors", spec, "--ratios", str(RATIO), "--jobs", "1"
    )
    assert_clean_error(result, code)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    message = " ".join(result.stderr.split())
    assert lines[0].startswith("Error: ") and f"{spec}:" in message, result.stderr
    assert says in message, result.stderr
    if line_of is not None:
        assert f"bad.py:{_line(text, line_of)}" in message, result.stderr
    assert "gradstat/" not in message and "unexpected" not in message


def test_a_failure_in_a_worker_process_is_named_the_same():
    """A --jobs worker's outcome travels pickled: the user's failure comes back as the
    same class, with its message and exit code, and is raised as one process would."""
    import pickle

    from gradstat.errors import UserCodeError
    from gradstat.parallel.units import Outcome, finish

    message = "bad.py:Mine: compress raised ZeroDivisionError: integer division (at bad.py:10)"
    travelled = pickle.loads(pickle.dumps(Outcome(error=UserCodeError(message)).portable()))
    with pytest.raises(UserCodeError) as caught:
        finish([travelled])
    assert str(caught.value) == message and caught.value.exit_code == 1


# --- training with it, and compare ------------------------------------------------------


def test_compare_replays_random_draws_with_the_runs_seed(tmp_path, capsys):
    """A run trained with --seed 3 and a random quantizer: the sent rows are the
    quantizer's draws seeded from (3, step, learner), and compare's replay of the run's
    own gradients draws the same (its error equals the one measured)."""
    from gradstat.store import layer_table
    from gradstat.store.schema import rank_file_name
    from gradstat.store.writer import RankFileWriter, finalize_root, write_root

    layers = layer_table([("fc.weight", (20, 30)), ("fc.bias", (20,))])
    d, n, steps, seed = layers[-1].stop, 2, 4, 3
    grads = np.random.default_rng(1).laplace(size=(n, steps, d)).astype(np.float32)
    spec = f"{EXAMPLE}:Quantize:bits=2"
    meta = {"workload": "arrays", "seed": seed, "compressor": spec}
    meta |= {"compressor_ratio": math.nan, "compressor_settings": "{}"}
    out = tmp_path / "quantized"
    out.mkdir()
    write_root(out, layers, n, "float32", meta)
    writers = [RankFileWriter(out / rank_file_name(r), r, d, sent=True) for r in range(n)]
    for s in range(steps):
        for r, writer in enumerate(writers):
            writer.append(s, 1.0, grads[r, s], quantized(grads[r, s], 2, seed, s, r), d + 4.0)
    for writer in writers:
        writer.close()
    finalize_root(out)
    result = run_cli(capsys, "compare", out, out, "--json", "--trained-with", f"{out}={spec}")
    assert result.code == 0, result.stderr
    rows = json.loads(result.stdout)["summary"]
    assert rows[0]["measured_rel_error"] == pytest.approx(rows[0]["replayed_rel_error"])


# slow: test_hooks.py trains through capture and compares with the replay (built-ins),
# and the worker-process test here loads a user's module the same way
@pytest.mark.slow
def test_trains_through_capture_and_compares(real_capture, tmp_path, capsys, monkeypatch):
    """``capture --compressor FILE.py:TopK`` with real gloo learners (2, 4 steps of the
    digits CNN of ``real_capture``): the recorded sent rows are the recursion's, the bytes
    12k, and ``compare`` takes the run beside the dense one."""
    monkeypatch.chdir(ROOT)
    spec = "examples/compressors.py:TopK+residual"
    out = tmp_path / "topk"
    result = run_cli(
        capsys, "capture", "--workload", "digits", "--steps", "4", "--nproc-per-node", "2",
        "--compressor", spec, "--ratio", str(RATIO), "--out", out,
    )  # fmt: skip
    assert result.code == 0, result.stderr
    with open_capture(out) as cap:
        assert cap.compressor["name"] == spec
        n, d = cap.world_size, cap.numel
        k = max(1, int(d * RATIO))
        memory = np.zeros((n, d), dtype=np.float32)
        for i, step in enumerate(cap.steps):
            p = cap.read_step(step).numpy() + memory
            sent = cap.read_step(step, dataset="sent").numpy()
            assert (np.count_nonzero(sent, axis=1) == k).all()
            top = np.sort(np.abs(p), axis=1)[:, -k]
            np.testing.assert_array_equal(sent, np.where(np.abs(p) >= top[:, None], p, 0))
            memory = p - sent
            assert (cap.sent_bytes[:, i] == 12 * k).all()
    compared = run_cli(
        capsys, "compare", real_capture, out, "--json", "--trained-with", f"{out}={spec}"
    )
    assert compared.code == 0, compared.stderr
    (row,) = json.loads(compared.stdout)["summary"][1:]
    assert row["measured_rel_error"] == pytest.approx(row["replayed_rel_error"], rel=1e-5)
    assert row["measured_bytes"] == row["predicted_bytes"] == 12 * k
    assert 0 < row["predicted_rel_error"] < 1  # the open-loop replay over the dense run
