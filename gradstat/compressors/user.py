"""A user's compressor class (GRACE's shape, docs/compressors.md) on gradstat's protocol.

:class:`UserCompressor` runs one per learner and message: ``compress`` gets a copy of the
vector and draws from torch's and numpy's global generators seeded from (seed, recorded
step, learner, message), their state outside kept; a failure inside the user's code is
a :class:`~gradstat.errors.UserCodeError` naming the spec, the method and the user's
file and line (:class:`Blame`).
"""

from __future__ import annotations

import copy
import inspect
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradstat.compressors.base import Compressor, Exchange
from gradstat.compressors.exchange import Call, Tensors
from gradstat.compressors.memory import Memory, NoMemory, ResidualMemory, UserMemory
from gradstat.errors import UserCodeError

COLLECTIVES = ("allgather", "allreduce")


def shown_path(path: str | os.PathLike) -> str:
    """A path as the user would write it: relative to the working directory when inside."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _defined_in(obj: Any) -> str | None:
    try:
        return inspect.getsourcefile(obj)
    except TypeError:
        return None


def user_frame(exc: BaseException, files: set[str]) -> str | None:
    """``file:line`` of the last traceback frame in one of the user's ``files`` (else the
    last frame outside gradstat, torch and the standard library), ``None`` if neither."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if os.path.realpath(f.filename) in files]
    if not mine:
        gradstat_dir = str(Path(__file__).resolve().parents[1])
        stdlib = os.path.dirname(os.__file__)
        mine = [
            f
            for f in frames
            if not f.filename.startswith((gradstat_dir, stdlib, os.path.dirname(torch.__file__)))
            and not f.filename.startswith("<")
        ]
    if not mine:
        return None
    return f"{shown_path(mine[-1].filename)}:{mine[-1].lineno}"


class Blame:
    """Turns exceptions raised inside a user's code into one line naming them.

    ``label`` is the spec as the user wrote it; ``cls`` the user's class (its file and
    those of its bases outside gradstat count as the user's files).
    """

    def __init__(self, label: str, cls: type) -> None:
        self.label = label
        self.cls = cls
        owners = getattr(cls, "__mro__", (cls,))  # a class and its bases, or a function
        self.files = {
            os.path.realpath(f) for f in (_defined_in(c) for c in owners) if f is not None
        }

    def error(self, method: str, message: str, where: str | None) -> UserCodeError:
        at = f" (at {where})" if where else ""
        return UserCodeError(f"{self.label}: {method} {message}{at}")

    def call(self, method: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)``; an exception becomes a :class:`UserCodeError`."""
        try:
            return function(*args, **kwargs)
        except UserCodeError:
            raise
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise self.error(method, f"raised {text}", user_frame(exc, self.files)) from exc

    def wrong(self, method: str, function: Any, message: str) -> UserCodeError:
        """An error about what ``method`` returned, at ``function``'s definition (where
        known)."""
        try:
            line = inspect.getsourcelines(function)[1]
            where = f"{shown_path(inspect.getsourcefile(function) or '?')}:{line}"
        except (OSError, TypeError):
            where = None
        return self.error(method, message, where)


@contextmanager
def seeded(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """torch's and numpy's global generators seeded with ``seed`` inside, restored after:
    the CPU's, and a CUDA ``device``'s where the tensor lives on one."""
    state = np.random.get_state()
    cuda = [device.index or 0] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            np.random.set_state(state)


def _describe(tensors: Any) -> str:
    if isinstance(tensors, (list, tuple)):
        return "(" + ", ".join(_describe(t) for t in tensors) + ")"
    if isinstance(tensors, torch.Tensor):
        return f"{str(tensors.dtype).removeprefix('torch.')}{list(tensors.shape)}"
    return type(tensors).__name__


class UserCompressor(Compressor):
    """A user's compressor object as a gradstat compressor, one per learner and message;
    ``k``: a sparsifier's target count (the quality column), else ``None``."""

    name = "user"

    def __init__(self, obj: Any, blame: Blame, *, k: int | None, numel: int, seed: int) -> None:
        self.obj = self.grace = obj  # ``grace``: what a GRACE memory's update is handed
        self.blame = blame
        self.k = k
        sparse = getattr(obj, "sparse", None)
        if sparse not in (None, True, False):
            raise blame.wrong("sparse", type(obj), f"is {sparse!r}; use True, False or None")
        self.sparse = sparse
        self.numel = numel
        collective = getattr(obj, "collective", "allgather")
        if collective not in COLLECTIVES:
            raise blame.wrong(
                "collective",
                type(obj),
                f"is {collective!r}; use one of {', '.join(COLLECTIVES)}",
            )
        self.collective = collective
        self.average = bool(getattr(obj, "average", True))
        self._seed = seed
        memory = getattr(obj, "memory", None)
        if isinstance(memory, str) and memory not in ("none", "residual"):
            raise blame.wrong("memory", type(obj), f"is {memory!r}; use none, residual or a class")
        self._memory = memory

    def memory(self) -> Memory:
        """The class's ``memory``: a GRACE memory class or function, ``"residual"``
        (gradstat's), else none (GRACE's default)."""
        made = self._memory
        if made is None or made == "none":
            return NoMemory()
        if made == "residual":
            return ResidualMemory()
        if not callable(made):
            prototype = made
            made = lambda: copy.deepcopy(prototype)  # noqa: E731 (an instance: one copy each)
        return UserMemory(made, self.blame, getattr(made, "__name__", "memory"))

    def exchange(self, p: torch.Tensor, call: Call) -> Exchange:
        """The generic exchange; ``compress`` draws from this call's seed."""
        self._seed = call.seed_of() % 2**32
        return (yield from super().exchange(p, call))

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        obj, blame = self.obj, self.blame
        with seeded(self._seed, tensor.device):
            result = blame.call("compress", obj.compress, tensor.clone(), name)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise blame.wrong(
                "compress", obj.compress, f"returned {_describe(result)}; return (tensors, ctx)"
            )
        tensors, ctx = result
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        if not isinstance(tensors, (tuple, list)) or not all(
            isinstance(t, torch.Tensor) for t in tensors
        ):
            raise blame.wrong(
                "compress",
                obj.compress,
                f"returned tensors {_describe(tensors)}; the tensors must be a list of tensors",
            )
        return tuple(tensors), ctx

    def decompress(self, tensors: Tensors, ctx: Any) -> torch.Tensor:
        """The user's ``decompress`` (a payload that travelled is read with this
        learner's ctx, as GRACE's communicators do)."""
        obj, blame = self.obj, self.blame
        try:
            dense = obj.decompress(list(tensors), ctx)
        except Exception as exc:
            where = user_frame(exc, blame.files)
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise blame.error(
                "decompress",
                f"cannot read the payload {_describe(tensors)} of compress: {text}",
                where,
            ) from exc
        if not isinstance(dense, torch.Tensor) or dense.numel() != self.numel:
            got = _describe(dense)
            raise blame.wrong(
                "decompress", obj.decompress, f"returned {got}; expected {self.numel} values"
            )
        return dense.reshape(-1).to(torch.float32)

    def describe(self, ctx: Any) -> dict[str, float]:
        """The class's ``describe(ctx)`` (numbers for the records), if it has one."""
        describe = getattr(self.obj, "describe", None)
        return {} if describe is None else dict(self.blame.call("describe", describe, ctx))

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The class's ``aggregate`` of the decoded vectors (GRACE's base class: their
        sum), else their sum; the drivers divide by the learners when ``average``."""
        function = getattr(self.obj, "aggregate", None)
        if function is None:
            return super().aggregate(tensors)
        total = self.blame.call("aggregate", function, list(tensors))
        if not isinstance(total, torch.Tensor) or total.numel() != self.numel:
            raise self.blame.wrong(
                "aggregate", function, f"returned {_describe(total)}; expected a tensor"
            )
        return total.reshape(-1).to(torch.float32)


def user_memory(named: Any) -> Memory:
    """The memory of a :class:`~gradstat.compressors.spec.MemorySpec` naming a user's
    class or function, made with its parameters once per learner."""
    factory = named.factory()
    params = dict(named.params)
    return UserMemory(lambda: factory(**params), Blame(named.label, factory), named.label)
