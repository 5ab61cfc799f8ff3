"""Compressor specs: ``COMPRESSOR[:PARAM=VALUE...][:collective=...][+MEMORY]`` as a user
names them (docs/compressors.md), parsed and checked.

``COMPRESSOR`` is a registry name (:mod:`gradstat.compressors.registry`) or a user's own
(``MODULE:CLASS``, ``FILE.py:CLASS``, an entry point: :mod:`gradstat.compressors.loader`);
``MEMORY`` is ``none``, ``residual``, ``dgc`` or a user's, named the same way. Mistakes
in a spec are :class:`~gradstat.errors.UsageError` (exit 2), a failure inside the user's
code a :class:`~gradstat.errors.UserCodeError` (exit 1); both name the spec, and the
user's file and line where there is one.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from gradstat.compressors.base import Compressor
from gradstat.compressors.loader import (
    DOCS,
    GROUP,
    REQUIRED,
    Value,
    check_params,
    entry_points,
    is_file,
    user_class,
)
from gradstat.compressors.registry import (
    BUILTIN_MEMORIES,
    CHOICES,
    REGISTRY,
    CompressorSpec,
    Context,
    Entry,
    grace_k,
)
from gradstat.compressors.user import COLLECTIVES, Blame, UserCompressor
from gradstat.errors import UsageError

#: The built-in memories named after ``+``: their classes' parameters and defaults.
MEMORIES: dict[str, dict[str, float]] = {
    name: {p.name: float(p.default) for p in inspect.signature(cls).parameters.values()}
    for name, cls in BUILTIN_MEMORIES.items()
}


def is_user_spec(part: str) -> bool:
    """Whether ``part`` (no registry name) names a user's compressor."""
    head, _, rest = part.partition(":")
    second = rest.split(":", 1)[0]
    return is_file(head) or (bool(rest) and "=" not in second) or head in entry_points()


def parse_value(text: str) -> Value:
    """A constructor argument: int, float, ``true``/``false``, else the text itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def format_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def split_spec(part: str) -> tuple[str, tuple[tuple[str, Value], ...]]:
    """``(source, params)`` of ``SOURCE[:PARAM=VALUE...]``; the source is ``MODULE:CLASS``,
    ``FILE.py:CLASS`` or an entry point's name."""
    head, *pieces = part.split(":")
    if pieces and "=" not in pieces[0]:
        head = f"{head}:{pieces.pop(0)}"
    params: dict[str, Value] = {}
    for piece in pieces:
        key, eq, value = piece.partition("=")
        if not eq or not key.isidentifier():
            raise UsageError(f"{part}: {piece!r} is not PARAM=VALUE")
        if key in params:
            raise UsageError(f"{part}: {key} is given twice")
        params[key] = parse_value(value)
    return head, tuple(params.items())


def build_user(label: str, source: str, params: Mapping[str, Value], ctx: Context) -> Compressor:
    """The user's class (or a function's result) built for ``ctx`` (its density, if it
    takes one), behind :class:`UserCompressor`; a subclass of gradstat's
    :class:`~gradstat.compressors.base.Compressor` runs as it is (its own exchange; its
    errors are not renamed)."""
    found = user_class(source)
    kwargs = dict(params)
    if found.ratio_name is not None and ctx.ratio is not None:
        kwargs[found.ratio_name] = ctx.ratio
    if found.takes_seed:
        kwargs.setdefault("seed", ctx.seed)
    blame = Blame(label, found.cls)
    made = "__init__" if inspect.isclass(found.cls) else found.cls.__name__
    obj = blame.call(made, found.cls, **kwargs)
    if isinstance(obj, Compressor):  # on gradstat's protocol already: its own exchange
        if obj.k is None:
            obj.k = ctx.k
        return obj
    for method in REQUIRED:
        if not callable(getattr(obj, method, None)):
            raise blame.wrong(made, found.cls, f"returned an object without {method}()")
    return UserCompressor(obj, blame, k=ctx.k, numel=ctx.numel, seed=ctx.seed)


def _joined(name: str, params: Sequence[tuple[str, Value]]) -> str:
    return ":".join([name, *(f"{k}={format_value(v)}" for k, v in params)])


@dataclass(frozen=True)
class UserSpec(CompressorSpec):
    """A user's compressor: ``name`` is its source (``MODULE:CLASS``, ``FILE.py:CLASS``
    or an entry point), ``params`` its constructor arguments. Checked when made (the
    class imports, has the methods, takes the parameters), also after travelling to
    another process."""

    params: tuple[tuple[str, Value], ...] = ()

    def __post_init__(self) -> None:
        check_params(self.base_label, user_class(self.name), dict(self.params))

    @property
    def entry(self) -> Entry:
        """Built by :func:`build_user`; a sparsifier if the class takes a density."""
        found = user_class(self.name)
        build = partial(build_user, self.label, self.name, dict(self.params))
        fixed = found.ratio_name is None
        return Entry(build, fixed, found.summary, collectives=COLLECTIVES, k_rule=grace_k)

    @property
    def base_label(self) -> str:
        """The spec as written: its source and every parameter given."""
        return _joined(self.name, self.params)


@dataclass(frozen=True)
class MemorySpec:
    """An error-feedback memory named after ``+``: a built-in (:data:`MEMORIES`, its
    parameters as floats) or a user's class or function (``name`` its source, ``params``
    its arguments), checked when made."""

    name: str
    params: tuple[tuple[str, Value], ...] = ()

    def __post_init__(self) -> None:
        if not self.builtin:
            check_params(
                _joined(self.name, self.params), user_class(self.name, "memory"), dict(self.params)
            )

    @property
    def builtin(self) -> bool:
        return self.name in MEMORIES

    @property
    def label(self) -> str:
        if not self.builtin:
            return _joined(self.name, self.params)
        defaults = MEMORIES[self.name]
        changed = [(k, v) for k, v in self.params if v != defaults[k]]
        return ":".join([self.name, *(f"{k}={v:g}" for k, v in changed)])

    def factory(self) -> Any:
        """The user's class or function (a built-in has none)."""
        return user_class(self.name, "memory").cls


def parse_memory(text: str, part: str) -> MemorySpec:
    """The :class:`MemorySpec` of ``MEMORY[:PARAM=VALUE...]`` (errors: exit 2)."""
    name, *assignments = text.split(":")
    if name not in MEMORIES:
        if not (is_file(name) or (assignments and "=" not in assignments[0])):
            known = ", ".join(MEMORIES)
            raise UsageError(
                f"{part}: unknown memory {name!r}; known: {known}, or your own as "
                f"MODULE:CLASS or FILE.py:CLASS ({DOCS})"
            )
        return MemorySpec(*split_spec(text))
    allowed = MEMORIES[name]
    params = dict(allowed)
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        if key not in allowed:
            known = ", ".join(allowed) or "none"
            raise UsageError(f"{part}: memory {name} has no parameter {key!r} (known: {known})")
        params[key] = _number(part, key, value)
    return MemorySpec(name, tuple(params.items()))


def _number(part: str, key: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"{part!r}: {key} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise UsageError(f"{part!r}: {key} must be finite")
    return number


def split_memory(part: str) -> tuple[str, str | None]:
    """``(compressor, memory)`` of ``COMPRESSOR+MEMORY`` (``memory`` None without ``+``).
    A ``+`` inside a number (``1e+3``) is no separator."""
    pieces = re.split(r"\+(?![0-9])", part)
    if len(pieces) > 2 or any(not p for p in pieces):
        raise UsageError(f"{part}: expected COMPRESSOR or COMPRESSOR+MEMORY")
    return pieces[0], pieces[1] if len(pieces) == 2 else None


def _collective(part: str, value: Value, allowed: Sequence[str], name: str) -> str:
    """A ``:collective=`` value, checked against what the compressor can do."""
    if value not in COLLECTIVES:
        raise UsageError(f"{part}: collective must be allgather or allreduce, got {value!r}")
    if value not in allowed:
        reason = "its payloads do not add up element-wise" if allowed else "its exchange is its own"
        raise UsageError(f"{part}: {name} cannot use collective={value} ({reason})")
    return str(value)


def _builtin(part: str, text: str, defaults: Mapping[str, float]) -> CompressorSpec:
    """A registry compressor ``NAME[:PARAM=VALUE...]`` (``defaults``: ``--rank``, ...)."""
    name, *assignments = text.split(":")
    entry = REGISTRY[name]
    allowed = entry.params
    params = {k: v for k, v in defaults.items() if k in allowed}
    collective = None
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        if key == "collective":
            collective = _collective(part, value, entry.collectives, name)
            continue
        if key not in allowed:
            known = ", ".join([*allowed, "collective"])
            raise UsageError(f"{part!r}: {name} has no parameter {key!r} (known: {known})")
        if key in CHOICES:
            if value not in CHOICES[key]:
                choices = ", ".join(CHOICES[key])
                raise UsageError(f"{part!r}: {key} must be one of {choices}, got {value!r}")
            params[key] = float(CHOICES[key].index(value))
            continue
        params[key] = _number(part, key, value)
    filled = tuple((key, float(params.get(key, default))) for key, default in allowed.items())
    return CompressorSpec(name, filled, collective=collective)


def _user(part: str, text: str) -> CompressorSpec:
    """A user's compressor ``SOURCE[:PARAM=VALUE...]``; ``collective=`` is gradstat's."""
    source, params = split_spec(text)
    given = dict(params)
    collective = given.pop("collective", None)
    if collective is not None:
        collective = _collective(part, collective, COLLECTIVES, source)
    return UserSpec(source, tuple(given.items()), collective=collective)


def _refuse_shadowing(name: str) -> None:
    """An installed package's entry point with a built-in's name is refused (it would
    be listed as the package's while the built-in runs)."""
    shadow = entry_points().get(name)
    if shadow is not None:
        raise UsageError(
            f"the entry point {name!r} ({shadow.value}) of an installed package has the "
            f"name of the built-in {name}: rename it in that package's {GROUP} entry points"
        )


def parse_compressors(
    spec: str | Sequence[str], defaults: Mapping[str, float] | None = None
) -> list[CompressorSpec]:
    """Parse ``topk,clt-k:beta=0.1,powersgd:rank=2,terngrad+residual`` (or a list of such
    names; see the module docstring).

    ``defaults`` overrides registry defaults for every compressor that has the parameter
    (e.g. ``--rank`` and ``--beta``), unless the name sets it itself.
    """
    parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    parts = [p for p in parts if p]
    if not parts:
        raise UsageError("give at least one compressor")
    specs = []
    for part in parts:
        text, memory = split_memory(part)
        name = text.split(":")[0]
        if name in REGISTRY:
            _refuse_shadowing(name)
            made = _builtin(part, text, defaults or {})
        elif is_user_spec(text):  # MODULE:CLASS, FILE.py:CLASS, entry point
            made = _user(part, text)
        else:
            raise UsageError(
                f"unknown compressor {name!r}; known: {', '.join(sorted(REGISTRY))}, "
                "or your own as MODULE:CLASS or FILE.py:CLASS (docs/compressors.md)"
            )
        if memory is not None:
            made = replace(made, memory=parse_memory(memory, part))
        specs.append(made)
    labels = [s.label for s in specs]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
        raise UsageError(f"compressor {duplicated[0]!r} is named twice")
    return specs
