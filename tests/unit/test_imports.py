"""megarl's imports point down the package layers and never form a cycle (DEVELOPERS.md, "Packages and layers").

The source is parsed with ``ast``; no megarl module is imported. Every ``megarl`` import counts,
at module level or inside a function, ``import x`` and ``from x import y``, relative ones resolved;
imports under ``if TYPE_CHECKING:`` do not. ``from megarl.pkg import name`` is an edge to the
submodule ``megarl.pkg.name`` when there is one, else to ``megarl/pkg/__init__.py``.
``megarl/__init__.py`` and ``megarl/__main__.py`` may import anything.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "megarl"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("controller",),
    ("plan",),
    ("workers",),
    ("sync",),
    ("rollout", "convert"),
    ("engines",),
    ("warmstart",),
    ("models",),
    ("parallel",),
    ("config",),
    ("algo", "data", "reward"),
    ("seeds", "_lazy", "errors"),
)
"""Top first: a package imports packages of its own layer or a lower one (DEVELOPERS.md's line)."""
LAYER_OF = {package: index for index, layer in enumerate(LAYERS) for package in layer}
ROOT_MODULES = {"megarl", "megarl.__main__"}
"""May import anything (the package's own entry points)."""


def layers_line(layers: tuple[tuple[str, ...], ...] = LAYERS) -> str:
    """``cli → controller → ... → algo, data, reward``: how DEVELOPERS.md writes the table."""
    return " → ".join(", ".join(layer) for layer in layers)


@dataclasses.dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` (module names) at ``file:line``."""

    importer: str
    imported: str
    file: str
    line: int
    missing: str | None = None
    """The module the statement names when no such file exists (a moved or deleted module)."""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_names(root: Path) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def package_of(module: str) -> str | None:
    """``models`` for ``megarl.models.tiny``; None for the root modules."""
    if module in ROOT_MODULES:
        return None
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except (unless ``type_checking``) the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a known module (``megarl.x.y.Class`` -> ``megarl.x.y``)."""
    parts = name.split(".")
    while len(parts) > 1 and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def collect_edges(root: Path = PACKAGE_ROOT, type_checking: bool = False) -> list[Edge]:
    """Every import of a module of ``root``'s package by a module of it (self-imports left out; those under
    ``if TYPE_CHECKING:`` only with ``type_checking``)."""
    modules = module_names(root)
    top = root.name
    edges = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        file = str(path.relative_to(root.parent))
        for node in _imports(ast.parse(path.read_text(), filename=file), type_checking):
            targets: list[str] = []
            named: list[str] = []  # the modules the statement names (must exist)
            if isinstance(node, ast.Import):
                targets = named = [alias.name for alias in node.names if alias.name.split(".")[0] == top]
            else:
                base = node.module or ""
                if node.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                if base.split(".")[0] != top:
                    continue
                named = [base]
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            missing = next((name for name in named if name not in modules), None)
            for target in targets:
                imported = _resolve(target, modules)
                if imported != module or missing:
                    edges.append(Edge(module, imported, file, node.lineno, missing))
    return edges


def missing_modules(edges: Iterable[Edge]) -> list[str]:
    """One message per import of a megarl module that does not exist."""
    return sorted({f"{e.where}: {e.importer} imports {e.missing}, which does not exist" for e in edges if e.missing})


def upward_imports(edges: Iterable[Edge]) -> list[str]:
    """One message per import of a package above the importer's (or of a package not in the table)."""
    problems = []
    for edge in edges:
        importer, imported = package_of(edge.importer), package_of(edge.imported)
        if importer is None or imported is None or importer == imported:
            continue
        for package in (importer, imported):
            if package not in LAYER_OF:
                problems.append(f"{edge.where}: package {package!r} is not in the layer table; add it to "
                                f"DEVELOPERS.md and tests/unit/test_imports.py LAYERS")
        if importer in LAYER_OF and imported in LAYER_OF and LAYER_OF[imported] < LAYER_OF[importer]:
            problems.append(f"{edge.where}: {importer} imports {edge.imported} ({imported}), a higher layer "
                            f"(layers, top first: {layers_line()})")
    return sorted(set(problems))


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first node: [a, b, ..., a]."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for succ in sorted(graph[node] & members):
            if succ == start:
                return paths[node] + [start]
            if succ not in paths:
                paths[succ] = paths[node] + [succ]
                queue.append(succ)
    raise AssertionError("a strongly connected component has a cycle")


def cycles(edges: Iterable[Edge], key) -> list[str]:
    """One message per cycle among ``key(module)`` nodes (modules or packages), naming each edge's file:line."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], Edge] = {}
    for edge in edges:
        a, b = key(edge.importer), key(edge.imported)
        if a is None or b is None or a == b:
            continue
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
        where.setdefault((a, b), edge)
    messages = []
    for component in _strongly_connected(graph):
        cycle = _cycle_in(component, graph)
        steps = [f"{a} -> {b} ({where[(a, b)].where})" for a, b in zip(cycle, cycle[1:])]
        messages.append("cycle: " + "; ".join(steps))
    return messages


# ----------------------------------------------------------------------------------- megarl itself


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return collect_edges()


def test_the_layer_table_is_the_one_in_developers_md():
    text = (REPO / "DEVELOPERS.md").read_text()
    found = re.findall(r"^Layers, top first: `([^`]+)`", text, flags=re.MULTILINE)
    assert found == [layers_line()], "DEVELOPERS.md's layer line and LAYERS here must say the same"
    listed = {match for match in re.findall(r"^- `([a-z_]+)(?:/|\.py)`", text, flags=re.MULTILINE)}
    assert listed == set(LAYER_OF), "DEVELOPERS.md lists one line per package of the layer table"


def test_every_package_is_in_the_layer_table():
    packages = {p.name for p in PACKAGE_ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages <= set(LAYER_OF), f"packages without a layer: {sorted(packages - set(LAYER_OF))}"


def test_imported_modules_exist(edges):
    problems = missing_modules(edges)
    assert not problems, "imports of missing modules:\n" + "\n".join(problems)


def test_imports_point_down_the_layers(edges):
    problems = upward_imports(edges)
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_packages_import_each_other_without_cycles(edges):
    problems = cycles(edges, package_of)
    assert not problems, "package cycles:\n" + "\n".join(problems)


def test_modules_import_each_other_without_cycles(edges):
    problems = cycles(edges, lambda module: module)
    assert not problems, "module cycles:\n" + "\n".join(problems)


def test_no_cycle_even_through_type_checking_imports():
    """Imports made only for type annotations do not run, but a cycle through them still means two modules that
    each need the other to be read: a layer that is not one."""
    problems = cycles(collect_edges(type_checking=True), lambda module: module)
    assert not problems, "module cycles through type-checking imports:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------- the checker itself


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "megarl"


def test_the_checker_sees_lazy_relative_and_from_imports_but_not_type_checking_ones(tmp_path):
    root = _write(tmp_path, {
        "megarl/__init__.py": "import megarl.cli.main\n",
        "megarl/cli/__init__.py": "",
        "megarl/cli/main.py": "from megarl.controller import run\n",
        "megarl/controller/__init__.py": "from .steps import run\n",
        "megarl/controller/steps.py": "def run():\n    from megarl.models import tiny\n",
        "megarl/models/__init__.py": "",
        "megarl/models/tiny.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megarl.cli import main\n"
                                  "from . import helpers\n"),
        "megarl/models/helpers.py": "from megarl.models.tiny import thing\n",
    })
    got = {(e.importer, e.imported, e.line) for e in collect_edges(root)}
    assert got == {("megarl", "megarl.cli.main", 1), ("megarl.cli.main", "megarl.controller", 1),
                   ("megarl.controller", "megarl.controller.steps", 1), ("megarl.controller.steps", "megarl.models.tiny", 2),
                   ("megarl.models.tiny", "megarl.models.helpers", 4), ("megarl.models.helpers", "megarl.models.tiny", 1)}
    edges = collect_edges(root)
    assert upward_imports(edges) == [] and missing_modules(edges) == []
    assert cycles(edges, package_of) == []
    assert cycles(edges, lambda m: m) == ["cycle: megarl.models.helpers -> megarl.models.tiny (megarl/models/helpers.py:1); "
                                          "megarl.models.tiny -> megarl.models.helpers (megarl/models/tiny.py:4)"]


def test_the_checker_names_upward_imports_and_package_cycles(tmp_path):
    root = _write(tmp_path, {
        "megarl/__init__.py": "",
        "megarl/models/__init__.py": "",
        "megarl/models/build.py": "def f():\n    from megarl.rollout.engine import X\n",
        "megarl/rollout/__init__.py": "",
        "megarl/rollout/engine.py": "from megarl.convert.export import Y\n",
        "megarl/convert/__init__.py": "",
        "megarl/convert/export.py": "from megarl.rollout import engine\n",
        "megarl/extra/__init__.py": "from megarl.models import build\n",
        "megarl/models/old.py": "def f():\n    from megarl.models.moved import g\n    import megarl.models.gone\n",
    })
    edges = collect_edges(root)
    assert missing_modules(edges) == ["megarl/models/old.py:2: megarl.models.old imports megarl.models.moved, which does not exist",
                                      "megarl/models/old.py:3: megarl.models.old imports megarl.models.gone, which does not exist"]
    problems = upward_imports(edges)
    assert problems[0].startswith("megarl/extra/__init__.py:1: package 'extra' is not in the layer table")
    assert problems[1] == (f"megarl/models/build.py:2: models imports megarl.rollout.engine (rollout), a higher layer "
                           f"(layers, top first: {layers_line()})")
    assert len(problems) == 2
    assert cycles(edges, package_of) == ["cycle: convert -> rollout (megarl/convert/export.py:1); "
                                         "rollout -> convert (megarl/rollout/engine.py:1)"]
