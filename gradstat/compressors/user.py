"""A user's compressor class (GRACE's shape) on gradstat's protocol.

A user's class needs two methods, GRACE's (Xu et al. 2021, ``grace_dl.torch.Compressor``):
``compress(tensor, name) -> (tensors, ctx)`` (the tensors go on the wire, ``ctx`` stays
with the learner) and ``decompress(tensors, ctx) -> tensor``. Optional, as in GRACE and
gradstat's protocol (:mod:`gradstat.compressors.base`): ``aggregate(decompressed)``
(default: their sum), ``average`` (default True: the aggregate is divided by the number
of learners), ``collective`` (``"allgather"``, or ``"allreduce"`` for payloads that add
up), ``sparse`` (how the elements sent are counted), ``describe(ctx)`` and ``memory``, a
GRACE memory (``compensate(tensor, name)`` / ``update(tensor, name, compressor,
tensors, ctx)``, e.g. GRACE's ``ResidualMemory``) or a class or function making one;
without it gradstat's residual error feedback runs (``m = p - decompress(compress(p))``).

:class:`UserCompressor` runs such an object, one per learner: bytes on the wire are the
payload tensors' sizes; each ``compress`` draws from torch's and numpy's global
generators seeded from the run's seed, the step and the learner (their state outside is
kept); a GRACE memory is applied around ``compress`` with the real payload and ``ctx``,
as GRACE's ``Communicator.send_step`` does; a failure inside the user's code is a
:class:`~gradstat.errors.UserCodeError` naming the spec, the method and the user's file
and line.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradstat.compressors.base import Compressor
from gradstat.compressors.exchange import Tensors
from gradstat.compressors.memory import Memory, NoMemory, ResidualMemory
from gradstat.compressors.work import Ops, passes
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


def definition(function: Any) -> str | None:
    """``file:line`` where a function or class is defined, ``None`` if unknown."""
    try:
        lines = inspect.getsourcelines(function)[1]
        return f"{shown_path(inspect.getsourcefile(function) or '?')}:{lines}"
    except (OSError, TypeError):
        return None


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
        """An error about what ``method`` returned, at its definition."""
        return self.error(method, message, definition(function))


def seed_for(seed: int, step: int, learner: int) -> int:
    """The seed of one learner's draws at one step (numpy's SeedSequence of the three)."""
    return int(np.random.SeedSequence([seed, step, learner]).generate_state(1, np.uint32)[0])


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


class OwnMemory(NoMemory):
    """The scheme's memory of a class that brings its own: the class's memory runs inside
    :meth:`UserCompressor.compress`; its norm is unknown to gradstat (NaN), its work
    priced as a residual memory's."""

    def update(self, i: int, p: torch.Tensor, sent: torch.Tensor, state: Any) -> None:
        self.norms.append(math.nan)

    def work(self, numel: int) -> Ops:
        return passes(6, numel, 2)


class UserCompressor(Compressor):
    """A user's compressor object (see the module docstring) as a gradstat compressor,
    one per learner (``learner``).

    ``k`` is the target count of a sparsifier (``None`` for fixed-rate ones), used for
    the quality column; unless the class sets ``sparse``, a sparsifier's elements sent and
    build-up are the non-zeros of its decompressed vectors (``sparse = None``) and a
    fixed-rate compressor sends every element (``False``).
    """

    name = "user"

    def __init__(
        self, obj: Any, blame: Blame, *, k: int | None, numel: int, seed: int, learner: int = 0
    ) -> None:
        self.obj = obj
        self.blame = blame
        self.k = k
        sparse = getattr(obj, "sparse", None if k is not None else False)
        if sparse not in (None, True, False):
            raise blame.wrong("sparse", type(obj), f"is {sparse!r}; use True, False or None")
        self.sparse = sparse
        self.numel = numel
        self.seed = seed
        self.learner = learner
        collective = getattr(obj, "collective", "allgather")
        if collective not in COLLECTIVES:
            raise blame.wrong(
                "collective",
                type(obj),
                f"is {collective!r}; use one of {', '.join(COLLECTIVES)}",
            )
        self.collective = collective
        self.average = bool(getattr(obj, "average", True))
        self._calls = 0
        self._own_memory: Any = None
        self._memory = getattr(obj, "memory", None)
        if isinstance(self._memory, str) and self._memory not in ("none", "residual"):
            raise blame.wrong(
                "memory", type(obj), f"is {self._memory!r}; use none, residual or a class"
            )

    @property
    def own_memory(self) -> bool:
        """Whether the class brings its own (GRACE-shaped) error-feedback memory."""
        return self._memory is not None and not isinstance(self._memory, str)

    def memory(self) -> Memory:
        """A class with its own memory applies it inside :meth:`compress`; a class with
        ``memory = "residual"`` gets gradstat's residual memory; any other none (GRACE's
        default)."""
        if self.own_memory:
            return OwnMemory()
        return ResidualMemory() if self._memory == "residual" else NoMemory()

    def _learner_memory(self) -> Any:
        memory = self._own_memory
        if memory is None:
            made = self._memory
            if inspect.isclass(made) or (callable(made) and not hasattr(made, "compensate")):
                made = self.blame.call("memory", made)
            else:
                made = copy.deepcopy(made)
            for method in ("compensate", "update"):
                if not callable(getattr(made, method, None)):
                    raise self.blame.wrong(
                        "memory", type(self.obj), f"has no {method} method (GRACE's Memory)"
                    )
            memory = self._own_memory = made
        return memory

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        step, self._calls = self._calls, self._calls + 1
        obj, blame = self.obj, self.blame
        memory = self._learner_memory() if self.own_memory else None
        with seeded(seed_for(self.seed, step, self.learner), tensor.device):
            if memory is not None:
                tensor = blame.call("memory.compensate", memory.compensate, tensor, name)
            result = blame.call("compress", obj.compress, tensor, name)
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
        if memory is not None:
            blame.call("memory.update", memory.update, tensor, name, obj, list(tensors), ctx)
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

    def settings(self) -> dict[str, float]:
        return {} if self.k is None else {"k": self.k}


class UserAggregating(UserCompressor):
    """A user's compressor with an ``aggregate`` of its own (the drivers divide by the
    number of learners when ``average``, GRACE's communicators)."""

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        function = self.obj.aggregate
        total = self.blame.call("aggregate", function, list(tensors))
        if not isinstance(total, torch.Tensor) or total.numel() != self.numel:
            raise self.blame.wrong(
                "aggregate", function, f"returned {_describe(total)}; expected a tensor"
            )
        return total.reshape(-1).to(torch.float32)


def adapter(obj: Any) -> type[UserCompressor]:
    """The adapter class for ``obj``: :class:`UserAggregating` where its class has an
    ``aggregate`` other than a plain sum (GRACE's base class sums, which the replay keeps
    as a running sum of one row)."""
    own = getattr(type(obj), "aggregate", None)
    plain = own is None or (
        getattr(own, "__qualname__", "") == "Compressor.aggregate"
        and (getattr(own, "__module__", "") or "").startswith("grace_dl")
    )
    return UserCompressor if plain else UserAggregating
