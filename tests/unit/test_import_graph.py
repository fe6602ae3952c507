"""The shape of the package, read from the code: which module imports which.

Every import counts, those under ``if TYPE_CHECKING:`` and inside functions included: a
cycle hidden from the interpreter is still a cycle for a reader. The rules (drawn in
docs/design.md, "The packages"):

- no cycle between modules;
- the pure cores (``kvcr.store``) import nothing of the runtime, the guard, the facade, trio
  or NIXL: the runtime and the guard both build on them;
- the guard may run runtimes, but the runtime never imports the guard;
- nothing below the facade imports it (``kvcr.api``, or the package root that re-exports it);
- every module opens with what it is for, in at most 500 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "kvcr").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imported(name: str, path: Path) -> Iterator[str]:
    """Every module ``name`` imports (``kvcr`` modules by their own name, others by their
    top-level package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # ``from kvcr.store import journal`` imports the module kvcr.store.journal.
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in MODULES else base for t in targets]
        else:
            continue
        for target in targets:
            if not target.startswith("kvcr"):
                yield target.split(".")[0]
                continue
            owner = target
            while owner and owner not in MODULES:
                owner = owner.rpartition(".")[0]
            if owner and owner != name:
                yield owner


GRAPH = {name: set(_imported(name, path)) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def _in(package: str) -> list[str]:
    return [m for m in GRAPH if m == package or m.startswith(package + ".")]


def test_the_graph_sees_the_package() -> None:
    assert "kvcr.store.index" in GRAPH and "kvcr.runtime.runtime" in GRAPH
    assert "kvcr.runtime.runtime" in GRAPH["kvcr.runtime.build"]
    assert "trio" in GRAPH["kvcr.runtime.runtime"]


def test_no_module_imports_itself_back_through_others() -> None:
    assert _cycles() == []


@pytest.mark.parametrize("module", _in("kvcr.store"))
def test_the_store_stands_on_its_own(module: str) -> None:
    outside = {
        m
        for m in GRAPH[module]
        if m in ("trio", "trio_util", "nixl", "nixl_cu12", "zmq")
        or m.startswith(("kvcr.runtime", "kvcr.guard", "kvcr.transport", "kvcr.g3"))
        or m in ("kvcr", "kvcr.api", "kvcr.instance", "kvcr.config")
    }
    assert not outside, f"{module} imports {sorted(outside)}"


@pytest.mark.parametrize("module", _in("kvcr.runtime"))
def test_the_runtime_does_not_import_the_guard(module: str) -> None:
    assert not {m for m in GRAPH[module] if m.startswith("kvcr.guard")}


@pytest.mark.parametrize(
    "module",
    [m for m in GRAPH if m.startswith(("kvcr.runtime", "kvcr.guard", "kvcr.store", "kvcr.g3"))]
    + [m for m in GRAPH if m.startswith(("kvcr.transport", "kvcr.config", "kvcr.instance"))],
)
def test_nothing_below_the_facade_imports_it(module: str) -> None:
    assert not GRAPH[module] & {"kvcr", "kvcr.api", "kvcr.testing"}, module


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_its_one_job_in_at_most_500_lines(module: str) -> None:
    path = MODULES[module]
    text = path.read_text()
    assert ast.get_docstring(ast.parse(text)), f"{path}: no header saying what it is for"
    lines = text.count("\n")
    assert lines <= 500, f"{path}: {lines} lines; split it by concept (docs/dev-guide.md)"
