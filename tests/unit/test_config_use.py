"""Every setting of the run config is used: a field that only its own checks read is a setting that does nothing.

The schema is walked from :class:`RunConfig` through every composed recipe; each field's name must be read as an
attribute (``section.field`` or ``getattr(section, "field")``) somewhere in ``megarl/`` outside the checks: not in
a ``__post_init__`` and not in ``megarl/config/checks.py``.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from megarl.config import CONFIG_DIR, RunConfig, load_config

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"
RECIPES = sorted(path.stem for path in (CONFIG_DIR / "recipe").glob("*.yaml"))
CHECKS_ONLY = {PACKAGE / "config" / "checks.py"}


class _Reads(ast.NodeVisitor):
    """Attribute names read by a module, outside ``__post_init__`` bodies."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name != "__post_init__":
            self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load):
            self.names.add(node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                self.names.add(node.args[1].value)
        self.generic_visit(node)


def _read_names() -> set[str]:
    reads = _Reads()
    for path in PACKAGE.rglob("*.py"):
        if path not in CHECKS_ONLY:
            reads.visit(ast.parse(path.read_text(), filename=str(path)))
    return reads.names


def _fields(section, prefix: str = ""):
    """``(key, field name)`` of every field under ``section`` (a dataclass instance), depth first."""
    for field in dataclasses.fields(section):
        key = f"{prefix}{field.name}"
        yield key, field.name
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(value, key + ".")


@pytest.fixture(scope="module")
def read_names() -> set[str]:
    return _read_names()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_setting_of_every_recipe_is_read(recipe, read_names):
    cfg = load_config([f"recipe={recipe}"])
    assert isinstance(cfg, RunConfig)
    unread = [key for key, name in _fields(cfg) if name not in read_names]
    assert not unread, (f"settings that no code reads (only their checks, if anything): {unread}; use them or "
                        f"remove them with an error that says so")


def test_the_check_catches_an_unread_setting():
    """The walk sees a field that nothing reads (and would not if the name were only checked)."""
    @dataclasses.dataclass
    class Section:
        never_read_anywhere_xyz: int = 0

    assert "never_read_anywhere_xyz" not in _read_names()
    assert [name for _, name in _fields(Section())] == ["never_read_anywhere_xyz"]
