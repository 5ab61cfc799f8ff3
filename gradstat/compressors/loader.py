"""Loading a user's compressor or memory: the class or function a spec names.

``MODULE:CLASS`` (importable from the working directory or ``PYTHONPATH``),
``path/to/file.py:CLASS`` (its folder joins the import path) or, for a compressor, the
name of an entry point of the group ``gradstat.compressors`` (docs/compressors.md). A
constructor that takes ``compress_ratio`` or ``ratio`` makes a sparsifier; one that takes
``seed`` gets ``--seed``. Whatever does not load or fit is a
:class:`~gradstat.errors.UsageError` (exit 2) naming the spec and the user's file and line.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradstat.compressors.base import Compressor
from gradstat.compressors.user import shown_path, user_frame
from gradstat.errors import UsageError

#: The entry-point group installed packages declare their compressors in.
GROUP = "gradstat.compressors"
#: Constructor parameters that take a sparsifier's density, in order of preference.
RATIO_NAMES = ("compress_ratio", "ratio")
#: The methods every compressor class must have, and every memory class.
REQUIRED = ("compress", "decompress")
MEMORY_REQUIRED = ("compensate", "update")
DOCS = "docs/compressors.md"
Value = int | float | bool | str


def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Installed packages' compressors: entry-point name -> entry point."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def is_file(head: str) -> bool:
    """Whether a spec's head names a Python file."""
    return head.endswith(".py") or "/" in head or os.sep in head


def _import_file(source: str, path: Path) -> Any:
    if not path.is_file():
        raise UsageError(f"{source}: no such file {path}")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    name = f"gradstat_user_{re.sub(r'[^0-9A-Za-z_]', '_', resolved.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.append(folder)  # the file may import its neighbours
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise UsageError(f"{source}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        raise _import_error(source, exc, {str(resolved)}) from exc
    return module


def _import_module(source: str, dotted: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # MODULE:CLASS from the working directory, as ``python -m``
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (dotted == exc.name or dotted.startswith(exc.name + ".")):
            raise UsageError(
                f"{source}: no module named {exc.name!r} in the working directory or on PYTHONPATH"
            ) from None
        raise _import_error(source, exc, set()) from exc
    except BaseException as exc:
        raise _import_error(source, exc, set()) from exc


def _import_error(source: str, exc: BaseException, files: set[str]) -> UsageError:
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{shown_path(exc.filename)}:{exc.lineno}"
        return UsageError(f"{source}: does not import: SyntaxError: {exc.msg} (at {where})")
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc
    where = user_frame(exc, files)
    at = f" (at {where})" if where else ""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return UsageError(f"{source}: does not import: {text}{at}")


def _resolve(source: str, what: str) -> Any:
    """The object ``source`` names: ``MODULE:NAME``, ``FILE.py:NAME`` or (a compressor)
    an entry point's name."""
    target = source
    if ":" not in source:
        found = entry_points().get(source) if what == "compressor" else None
        if found is None and is_file(source):
            raise UsageError(f"{source}: name the class too, as {source}:CLASS")
        if found is None:
            raise UsageError(f"unknown {what} {source!r}")
        target = found.value
        if ":" not in target:
            raise UsageError(f"{source}: entry point {target!r} names no MODULE:CLASS")
    where, _, qualname = target.rpartition(":")
    from_file = is_file(where)
    module = _import_file(source, Path(where)) if from_file else _import_module(source, where)
    found: Any = module
    for attribute in qualname.split("."):
        found = getattr(found, attribute, None)
        if found is None:
            classes = sorted(
                n
                for n, v in vars(module).items()
                if inspect.isclass(v) and callable(getattr(v, "compress", None))
            )
            hint = f" (it has: {', '.join(classes)})" if classes else ""
            raise UsageError(f"{source}: {shown_path(where)} has no class {qualname!r}{hint}")
    return found


@functools.cache
def load_factory(source: str, what: str, cwd: str) -> Any:
    """The class or function ``source`` names (see the module docstring), once per
    process and working directory ``cwd``; a class must have the methods of a ``what``
    (``compressor`` or ``memory``); a function's result is checked when it is called."""
    found = _resolve(source, what)
    qualname = source.rpartition(":")[2]
    if inspect.isfunction(found):
        return found
    if not inspect.isclass(found):
        raise UsageError(
            f"{source}: {qualname} is a {type(found).__name__}, not a class or function"
        )
    required = REQUIRED if what == "compressor" else MEMORY_REQUIRED
    for method in required:
        own = getattr(found, method, None)
        if not callable(own) or own is getattr(Compressor, method, None):  # a placeholder
            needs = ", ".join(f"{m}()" for m in required)
            raise UsageError(
                f"{source}: {qualname} has no {method} method (a {what} needs {needs}; {DOCS})"
            )
        if getattr(own, "__isabstractmethod__", False):
            raise UsageError(f"{source}: {qualname}.{method} is abstract (GRACE's base class)")
    return found


@dataclass(frozen=True)
class UserClass:
    """A user's class or function and what it takes."""

    source: str
    cls: Any
    signature: inspect.Signature

    @property
    def ratio_name(self) -> str | None:
        """The parameter the density goes to, ``None`` for a fixed-rate compressor."""
        names = self.signature.parameters
        return next((n for n in RATIO_NAMES if n in names), None)

    @property
    def takes_seed(self) -> bool:
        return "seed" in self.signature.parameters

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(self.cls) or ""
        return doc.split("\n\n")[0].replace("\n", " ") or self.cls.__name__


def user_class(source: str, what: str = "compressor") -> UserClass:
    """The class or function ``source`` names with its signature."""
    cls = load_factory(source, what, os.getcwd())
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        signature = inspect.Signature()
    return UserClass(source, cls, signature)


def check_params(part: str, found: UserClass, params: Mapping[str, Value]) -> None:
    taken = [
        name
        for name, p in found.signature.parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    name = found.cls.__name__
    for key in params:
        if key in RATIO_NAMES and found.ratio_name == key:
            raise UsageError(f"{part}: give {name}'s density with --ratios, not {key}=")
    fixed = {found.ratio_name: 0.5} if found.ratio_name else {}
    if found.takes_seed:
        fixed.setdefault("seed", 0)
    try:
        found.signature.bind(**{**fixed, **params})
    except TypeError as exc:
        message = str(exc)
        missing = re.search(r"missing a required argument: '(\w+)'", message)
        if missing:
            raise UsageError(
                f"{part}: {name} needs {missing.group(1)} (give {part}:{missing.group(1)}=VALUE)"
            ) from None
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", message)
        known = ", ".join(t for t in taken if t not in RATIO_NAMES) or "none"
        what = f"no parameter {unexpected.group(1)!r}" if unexpected else message
        raise UsageError(f"{part}: {name} takes {what} (its parameters: {known})") from None
    for key, value in params.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{part}: {key} must be finite")
