"""The import graph of the production packages, read from their source (no module is imported):
no circles, type-only and function-level imports included, and nothing outside
``tierstore.testing`` imports it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The packages the wheel ships, as pyproject.toml lists them (a new tier package is covered).
PACKAGES = tuple(re.findall(r'"(\w+)\*"', re.search(
    r"\[tool\.setuptools\.packages\.find\]\s*include = \[(.*?)\]",
    (ROOT / "pyproject.toml").read_text(), re.S).group(1)))  # type: ignore[union-attr]
TESTING = "tierstore.testing"
LOWER = tuple(p for p in PACKAGES if p != "tierstore")


def _modules() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The module of the packages that importing ``name`` runs last (``name`` itself, else
    the nearest package above it); None for a module from elsewhere."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Modules of the packages that ``module`` imports anywhere in its body: at the top,
    under ``if TYPE_CHECKING:``, inside functions."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_target(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from pkg import submodule` imports pkg.submodule
                found.add(_target(f"{base}.{alias.name}") if f"{base}.{alias.name}" in MODULES
                          else _target(base))
    found.discard(None)
    found.discard(module)
    return {m for m in found if m is not None}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _edges_within(component: list[str]) -> list[str]:
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(GRAPH[a] & members)]


def test_the_graph_is_read() -> None:
    # The reader finds what it must: a top-level, a relative, a type-only and a package import.
    assert "tierstore.store" in MODULES and "gpu_arena" in MODULES
    assert "tierstore.radix" in GRAPH["tierstore.movement"]
    assert "gpu_arena" in GRAPH["tierstore.store"]
    assert any(MODULES[m].name == "__init__.py" and GRAPH[m] for m in LOWER)


def test_circles_are_found() -> None:
    # The check itself, on a made-up graph: a -> b -> c -> a is one circle, d is outside it.
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    circles = _circles(GRAPH)
    assert not circles, "import circles (type-only and function-level imports count):\n" + \
        "\n".join("  " + "; ".join(_edges_within(c)) for c in circles)


def test_production_code_does_not_import_testing() -> None:
    # tierstore.testing holds what tests use; a production module importing it ships test code
    # as a feature (the embedded L3 launcher lived there until it got a production home).
    upward = sorted(f"{m} -> {t}" for m, targets in GRAPH.items()
                    if not (m == TESTING or m.startswith(TESTING + "."))
                    for t in targets if t == TESTING or t.startswith(TESTING + "."))
    assert not upward, ("production modules import tierstore.testing (move what they use "
                        "into a production module):\n  " + "\n  ".join(upward))


@pytest.mark.parametrize("package", LOWER)
def test_lower_packages_import_nothing_of_tierstore_but_its_errors(package: str) -> None:
    # The tiers are mechanism: of tierstore they may know only the exception root, and the
    # loader of compiled hot paths (tierstore.native, itself importing nothing of ours).
    allowed = ("tierstore.errors", "tierstore.native")
    above = sorted(f"{m} -> {t}" for m, targets in GRAPH.items()
                   if m == package or m.startswith(package + ".")
                   for t in targets if t.split(".")[0] == "tierstore" and t not in allowed)
    assert not above, "\n".join(above)
    assert not GRAPH["tierstore.native"], GRAPH["tierstore.native"]


def test_importing_the_errors_loads_nothing_else() -> None:
    # tierstore.errors is the root every package's exceptions derive from: importing it (and so
    # tierstore/__init__) must not import the store, or a lower package importing it would
    # start a circle at run time.
    code = ("import sys, tierstore.errors; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{PACKAGES!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == "['tierstore', 'tierstore.errors']", out
