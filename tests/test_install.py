"""Every third-party module gradstat imports is a dependency its installed metadata
declares: `pip install gradstat` (no extras) must run every command.

The check walks gradstat's sources with ``ast`` (``import``, ``from ... import`` and
``importlib.import_module("name")``), maps each top-level module to the distributions
that install it (``importlib.metadata.packages_distributions``) and compares them with
``importlib.metadata.requires("gradstat")``: an import that runs unconditionally needs a
base dependency; an import guarded by ``try: ... except ImportError`` may name an extra's
distribution (``pip install 'gradstat[lightning]'``) or one of the optional packages
listed below.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from importlib.metadata import packages_distributions, requires
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / "gradstat"

#: Optional imports that no extra declares, each with what happens without it.
UNDECLARED_FALLBACKS = {
    "torchvision": "resnet50 builds the same network itself where torchvision does not import",
    "pytorch_lightning": "the standalone Lightning package, tried where `lightning` is absent",
}
#: Exceptions whose handler makes an import optional.
GUARDS = {"ImportError", "ModuleNotFoundError", "Exception"}


def _normal(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> dict[str, set[str | None]]:
    """Installed gradstat's requirements: distribution -> the extras that bring it (None:
    a base dependency)."""
    declared: dict[str, set[str | None]] = {}
    for line in requires("gradstat") or []:
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line).group(0)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", line)
        declared.setdefault(_normal(name), set()).add(extra.group(1) if extra else None)
    return declared


def _catches_import_errors(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(name, ast.Name) and name.id in GUARDS for name in caught)


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` sits in the body of a ``try`` that catches an import failure."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if (
            isinstance(parent, ast.Try)
            and child in parent.body
            and any(_catches_import_errors(h) for h in parent.handlers)
        ):
            return True
        child, parent = parent, parents.get(parent)
    return False


def _imported(node: ast.AST) -> list[str]:
    """The top-level module names one node imports."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module.split(".")[0]]
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value.split(".")[0]]
    return []


@cache
def _distributions() -> dict[str, list[str]]:
    return packages_distributions()


@cache
def third_party_imports() -> dict[str, list[tuple[str, bool]]]:
    """module -> [(file:line, guarded)] for every import of a module outside the
    standard library and gradstat."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(SOURCES.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            for module in _imported(node):
                if module in sys.stdlib_module_names or module in ("gradstat", "__future__"):
                    continue
                where = f"{path.relative_to(SOURCES.parent)}:{node.lineno}"
                found.setdefault(module, []).append((where, _guarded(node, parents)))
    return found


def test_the_walk_finds_what_gradstat_imports():
    """The walk sees plain, lazy (in a function), guarded and import_module imports."""
    found = third_party_imports()
    assert {"torch", "numpy", "typer", "matplotlib", "h5py"} <= set(found)
    assert all(not guarded for _, guarded in found["typer"])
    assert any(guarded for _, guarded in found["hdf5plugin"])  # import_module("hdf5plugin")
    assert all(guarded for _, guarded in found["lightning"])


def test_every_import_is_a_declared_dependency():
    declared = _requirements()
    base = {name for name, extras in declared.items() if None in extras}
    owners = {module: {_normal(d) for d in dists} for module, dists in _distributions().items()}
    faults = []
    for module, sites in sorted(third_party_imports().items()):
        dists = owners.get(module) or {_normal(module)}  # not installed: its own name
        plain = [where for where, guarded in sites if not guarded]
        if plain and not dists & base:
            faults.append(
                f"{module} ({', '.join(plain)}) is imported unconditionally but "
                f"{sorted(dists) or 'its distribution'} is no base dependency"
            )
        elif not plain and not dists & set(declared) and module not in UNDECLARED_FALLBACKS:
            faults.append(f"{module} ({sites[0][0]}) is optional but no extra declares it")
    assert not faults, "\n".join(faults)
    for module in UNDECLARED_FALLBACKS:  # a fallback is never imported unguarded
        assert all(guarded for _, guarded in third_party_imports().get(module, [])), module


def test_every_base_dependency_is_used():
    """No stale base dependency: each one installs a module gradstat imports."""
    imported = set(third_party_imports())
    provides: dict[str, set[str]] = {}
    for module, dists in _distributions().items():
        for dist in dists:
            provides.setdefault(_normal(dist), set()).add(module)
    base = [name for name, extras in _requirements().items() if None in extras]
    unused = [name for name in base if not provides.get(name, set()) & imported]
    assert not unused, f"declared but never imported: {unused}"


def test_the_installed_metadata_is_this_trees():
    """The metadata checked above is pyproject.toml's (a stale install would hide a
    missing dependency): reinstall with `make setup` when this fails."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pytest needs tomli before Python 3.11
        import tomli as tomllib
    project = tomllib.loads((SOURCES.parent / "pyproject.toml").read_text())["project"]
    wanted = {
        (_normal(re.match(r"[A-Za-z0-9._-]+", r).group(0)), None) for r in project["dependencies"]
    }
    for extra, reqs in project["optional-dependencies"].items():
        wanted |= {(_normal(re.match(r"[A-Za-z0-9._-]+", r).group(0)), extra) for r in reqs}
    installed = {(name, extra) for name, extras in _requirements().items() for extra in extras}
    assert installed == wanted, "gradstat's installed metadata is stale: run `make setup`"
