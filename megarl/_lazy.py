"""Names a package loads from its submodules on first use (PEP 562), so a light submodule imports nothing heavy."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def first_use(package: str, modules: Mapping[str, tuple[str, ...]], namespace: dict) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name of ``modules[submodule]`` is loaded from
    ``package.submodule`` when first asked for, then kept in ``namespace`` (the package's globals). No name may be a
    submodule's: importing a submodule sets the package's attribute of its name."""
    home = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        namespace[name] = value
        return value

    __getattr__.names = frozenset(home)
    return __getattr__
