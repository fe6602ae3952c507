"""The store (src/kvcr/store) stays pure: none of its modules imports trio, NIXL, the
runtime, the guard or the API, not even for type checking, so a compiled core can take its
place and both the runtime and the guard can build on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvcr.store

STORE = Path(kvcr.store.__file__).parent
FORBIDDEN = ("trio", "nixl", "kvcr.runtime", "kvcr.guard", "kvcr.api")
MODULES = sorted(STORE.rglob("*.py"))


def imported(tree: ast.AST) -> list[str]:
    """Every module an ``import`` or ``from ... import`` anywhere in ``tree`` names (inside
    functions and ``if TYPE_CHECKING:`` blocks too); ``from kvcr import runtime`` names
    ``kvcr.runtime``."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_the_store_has_modules() -> None:
    assert len(MODULES) > 10
    assert STORE / "journal" / "writer.py" in MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(STORE)))
def test_a_store_module_imports_nothing_of_the_runtime_the_guard_or_trio(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    assert not [name for name in imported(tree) if forbidden(name)]
    # A relative import would escape the check: the store uses absolute ones only.
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]


def test_the_check_sees_imports_under_type_checking() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trio\n"
    assert any(forbidden(name) for name in imported(ast.parse(source)))
    assert any(forbidden(n) for n in imported(ast.parse("from kvcr import runtime")))
