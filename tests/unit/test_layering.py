"""The layering docs/architecture.md states, enforced: imports only go down. `events`
imports nothing of the project, `runtime` only `events`, a consumer never imports the
gateway or another consumer, only `infra` imports the processes; inside the inference
package the engine knows no runner and no worker, and the runners no worker. And no
import circle, not even one hidden by an import inside a function.

Read from the sources (every import, a function's own included; those under
``if TYPE_CHECKING:`` do not run, and are left out of the circles)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("events", "runtime", "consumers", "gateway", "infra")

#: (importer, imported): a module under the first may import none under the second.
#: The consumers' rule (no other consumer) is checked apart, for each consumer.
FORBIDDEN = [
    ("events", "runtime"),
    ("events", "consumers"),
    ("events", "gateway"),
    ("events", "infra"),
    ("runtime", "consumers"),
    ("runtime", "gateway"),
    ("runtime", "infra"),
    ("consumers", "gateway"),
    ("consumers", "infra"),
    ("gateway", "consumers"),
    ("gateway", "infra"),
    ("consumers.inference.engine", "consumers.inference.runners"),
    ("consumers.inference.engine", "consumers.inference.worker"),
    ("consumers.inference.engine", "consumers.inference.app"),
    ("consumers.inference.runners", "consumers.inference.worker"),
    ("consumers.inference.runners", "consumers.inference.app"),
    ("consumers.inference.worker", "consumers.inference.app"),
]

#: Circles still there, each with the issue that removes it. Only these may stay.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, modules: set[str], with_type_checking: bool = True) -> set[str]:
    """The project modules ``name`` imports: ``from a import b`` imports ``a.b`` where that
    is a module, else ``a``; its own packages (imported before it anyway) are left out."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    if not with_type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _type_checking(node):
                skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def graph(with_type_checking: bool = True) -> dict[str, set[str]]:
    """Each project module and the project modules it imports."""
    mods = sources()
    return {name: imports(name, path, set(mods), with_type_checking) for name, path in mods.items()}


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import that breaks a rule, as 'importer -> imported (rule)'."""
    broken = []
    for importer, targets in sorted(edges.items()):
        for target in sorted(targets):
            for high, low in FORBIDDEN:
                if under(importer, high) and under(target, low):
                    broken.append(f"{importer} -> {target} ({high} must not import {low})")
            if under(importer, "consumers") and under(target, "consumers"):
                mine, theirs = importer.split(".")[:2], target.split(".")[:2]
                if len(mine) == 2 and len(theirs) == 2 and mine != theirs:
                    broken.append(f"{importer} -> {target} (a consumer imports another)")
    return broken


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_points_up_a_layer():
    assert upward(graph()) == []


def test_no_import_circle_but_the_known_ones():
    found = {c: ", ".join(sorted(c)) for c in circles(graph(with_type_checking=False))}
    assert [names for c, names in found.items() if c not in KNOWN_CIRCLES] == []


@pytest.mark.parametrize(
    ("importer", "source", "rule"),
    [
        ("events.models", "from gateway.app import build_app\n", "events must not import gateway"),
        ("runtime.process", "def f():\n    from consumers.inference import app\n", "runtime must not import consumers"),
        ("consumers.filter.app", "import consumers.delivery.app\n", "a consumer imports another"),
        (
            "consumers.inference.engine.batch",
            "from ..runners.thread import EngineRunner\n",
            "consumers.inference.engine must not import consumers.inference.runners",
        ),
    ],
)
def test_an_upward_import_is_caught(importer, source, rule, tmp_path):
    """Each rule fails on the import it forbids, a function's own and a relative one too."""
    path = tmp_path / "module.py"
    path.write_text(source)
    edges = graph()
    names = set(sources())
    edges[importer] = imports(importer, path, names)  # as if it stood in place
    assert any(rule in line for line in upward(edges)), upward(edges)


def test_a_circle_hidden_in_a_function_is_caught():
    edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert circles(edges) == [frozenset({"a", "b"})]
