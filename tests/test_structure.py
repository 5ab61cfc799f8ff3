"""The package's shape: no private APIs, no import circle, short files, working docs."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gradstat"
SOURCES = sorted(PACKAGE.rglob("*.py"))

#: Private interpreter, numpy and C-library internals gradstat must not touch.
PRIVATE_APIS = {
    "CPython's _imp / _thread": re.compile(r"^\s*(import|from)\s+_(imp|thread)\b|\b_imp\.", re.M),
    "numpy's private _core": re.compile(r"\b(np|numpy)\._core\b|_set_madvise_hugepage"),
    "glibc's mallopt": re.compile(r"\bmallopt\b"),
    "the C library through ctypes": re.compile(r"^\s*import ctypes|ctypes\.(CDLL|util)", re.M),
    "interpreter frames": re.compile(r"\bsys\._getframe\b|\bf_code\b|\btb_frame\b"),
    "h5py's private modules": re.compile(r"\bh5py\._|\bfrom\s+h5py\s+import\s+_"),
}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_module_uses_private_interpreter_numpy_or_libc_apis():
    found = [
        f"{_relative(path)}: {what}"
        for path in SOURCES
        for what, pattern in PRIVATE_APIS.items()
        if pattern.search(path.read_text())
    ]
    assert not found, found


def test_the_private_api_check_finds_what_it_looks_for():
    samples = {
        "CPython's _imp / _thread": "import _imp\n",
        "numpy's private _core": "np._core.multiarray\n",
        "glibc's mallopt": "libc.mallopt(1, 2)\n",
        "the C library through ctypes": "import ctypes\n",
        "interpreter frames": "frame = sys._getframe()\n",
        "h5py's private modules": "lock = h5py._objects.phil\n",
    }
    for what, sample in samples.items():
        assert PRIVATE_APIS[what].search(sample), what


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node that runs: all but the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _imported(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module name a ``from ... import`` reads from."""
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """gradstat module name -> its file, under ``root`` (a checkout)."""
    return {_module_name(p, root): p for p in sorted((root / "gradstat").rglob("*.py"))}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """gradstat module -> the gradstat modules it imports when it runs (at the top or
    inside a function: a lazy import is still an edge; type-checking imports are not)."""
    modules = package_modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _imported(node, name, path.name == "__init__.py")
                for alias in node.names:  # a submodule by name, else the module itself
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        # a module always needs its parent packages: no edge to them
        graph[name] = {
            e for e in edges if e in modules and name != e and not name.startswith(e + ".")
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "gradstat.parallel.runner" in graph["gradstat.parallel"]  # the walk sees edges
    assert cycles(graph) == []


def test_the_circle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: Each part of the package and its layer (docs/architecture.md, "Layers"): a module
#: may import its own layer and the layers below, never one above. "" is the package
#: itself; the small shared modules every layer may use are layer 0.
LAYERS = {
    "__main__": 6,
    "cli": 6,
    "report": 5,
    "plots": 5,
    "analysis": 4,
    "parallel": 3,
    "stats": 2,
    "compressors": 2,
    "store": 1,
    "wire": 1,
    **dict.fromkeys(("", "errors", "cancel", "sizes", "threads", "formatting"), 0),
    **dict.fromkeys(("defaults", "lazy", "atomic", "untrusted"), 0),
}
#: At the side, inside training: these may import each other and the layers up to
#: ``SIDE_REACH`` (the math and the store); only the command line imports them.
SIDE = ("capture", "hooks", "integrations")
SIDE_REACH = 2


def _part(module: str) -> str:
    """``gradstat.stats.sidco`` -> ``stats``; the package itself -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def _layer(part: str) -> int:
    assert part in LAYERS or part in SIDE, f"gradstat.{part} has no layer: add it to LAYERS"
    return LAYERS.get(part, SIDE_REACH)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for each import that goes up a layer (or into the side
    packages from below the command line)."""
    found = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            a, b = _part(module), _part(other)
            if a == b:
                continue
            if b in SIDE:
                allowed = a in SIDE or _layer(a) == max(LAYERS.values())
            else:
                allowed = _layer(b) <= (SIDE_REACH if a in SIDE else _layer(a))
            if not allowed:
                found.append(f"{module} -> {other}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module(dotted: str, importer: str) -> str | None:
    """The first private component of a module path that ``importer`` is outside of
    (a private module is its package's own)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _private(part) and not importer.startswith(".".join(parts[:i]) + "."):
            return ".".join(parts[: i + 1])
    return None


def private_uses(paths: list[Path], modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """``file:line name`` for each private name of a gradstat module used outside it:
    imported (``from gradstat.x import _y``), read from an imported module
    (``x._y``), or a private module imported from outside its package."""
    names = {path: name for name, path in modules.items()}
    found = []
    for path in paths:
        importer = names.get(path, "tests")
        where = path.relative_to(root).as_posix()
        aliases: dict[str, str] = {}  # local name -> the gradstat module it is
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "gradstat":
                        targets.append(alias.name)
                        local = alias.asname or alias.name.split(".")[0]
                        aliases[local] = alias.name if alias.asname else "gradstat"
            elif isinstance(node, ast.ImportFrom):
                base = _imported(node, importer, path.name == "__init__.py")
                if base.split(".")[0] != "gradstat":
                    continue
                targets.append(base)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        targets.append(full)
                        aliases[alias.asname or alias.name] = full
                    elif _private(alias.name) and base != importer:
                        found.append(f"{where}:{node.lineno} {full}")
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
                and f"{aliases[node.value.id]}.{node.attr}" not in modules
                and aliases[node.value.id] != importer
            ):
                found.append(f"{where}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
            for target in targets:
                private = _private_module(target, importer)
                if private is not None:
                    found.append(f"{where}:{node.lineno} {private}")
    return sorted(set(found))


def _check_tree(root: Path) -> tuple[list[str], list[str]]:
    """(upward imports, private uses) of the checkout at ``root`` (package and tests)."""
    modules = package_modules(root)
    paths = [*modules.values(), *sorted((root / "tests").glob("*.py"))]
    return upward_imports(import_graph(root)), private_uses(paths, modules, root)


def test_imports_go_one_way_and_no_private_name_crosses_a_module():
    upward, private = _check_tree(ROOT)
    assert upward == []
    assert private == []


def test_the_wire_imports_nothing_of_gradstat_but_the_errors():
    graph = import_graph()
    wire = {m: e for m, e in graph.items() if m.startswith("gradstat.wire")}
    assert "gradstat.wire.hops" in wire["gradstat.wire.collectives"]  # the walk sees edges
    outside = {e for edges in wire.values() for e in edges if not e.startswith("gradstat.wire")}
    assert outside <= {"gradstat.errors"}


def test_the_direction_check_finds_a_planted_upward_or_private_import(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "gradstat")
    (tmp_path / "tests").mkdir()
    assert _check_tree(tmp_path) == ([], [])
    density = tmp_path / "gradstat" / "stats" / "density.py"
    text = density.read_text()
    density.write_text(text + "\n\ndef late():\n    from gradstat.analysis import selection\n")
    assert _check_tree(tmp_path)[0] == ["gradstat.stats.density -> gradstat.analysis.selection"]
    density.write_text(text)
    hooks = tmp_path / "gradstat" / "hooks" / "compression.py"
    hooks.write_text(hooks.read_text() + "\nfrom gradstat.parallel import runner\n")
    assert _check_tree(tmp_path)[0] == ["gradstat.hooks.compression -> gradstat.parallel.runner"]
    hooks.unlink()
    (tmp_path / "tests" / "test_x.py").write_text(
        "from gradstat.stats.row_kernels import _found\n"
        "from gradstat.stats import row_kernels\n"
        "row_kernels._finite(0)\n"
        "from gradstat.stats._row_loops import PIECE\n"
    )
    assert _check_tree(tmp_path)[1] == [
        "tests/test_x.py:1 gradstat.stats.row_kernels._found",
        "tests/test_x.py:3 gradstat.stats.row_kernels._finite",
        "tests/test_x.py:4 gradstat.stats._row_loops",
    ]


def fenced_blocks(text: str) -> tuple[list[tuple[str, str]], bool]:
    """``(language, body)`` of each fenced block, and whether every fence closed."""
    blocks, language, body, inside = [], "", [], False
    for line in text.splitlines():
        fence = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if fence and not inside:
            inside, language, body = True, fence.group(2), []
        elif fence and inside and not fence.group(2):
            blocks.append((language, "\n".join(body)))
            inside = False
        elif inside:
            body.append(line)
    return blocks, not inside


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_fenced_block_closes(doc):
    assert fenced_blocks(doc.read_text())[1], f"{doc.name}: a fenced block never closes"


def test_the_readmes_python_blocks_parse():
    blocks, _ = fenced_blocks((ROOT / "README.md").read_text())
    assert any(language == "python" for language, _ in blocks)
    for language, body in blocks:
        if language == "python":
            ast.parse(body)  # a SyntaxError names the line


def test_the_fence_check_sees_an_open_block_and_prose_in_code():
    assert fenced_blocks("```python\nx = 1\n```\n") == ([("python", "x = 1")], True)
    assert not fenced_blocks("```\nopen\n")[1]
    # the README's old fault: an opening fence read as a closing one put prose in code
    blocks, _ = fenced_blocks("```\n\nText.\n\n```\ncode\n```\npython\nx = 1\n```\n")
    assert blocks[0] == ("", "\nText.\n")
