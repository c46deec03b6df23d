"""Megatron-Core's fused elementwise functions eager from their import on (``megarl.parallel.megatron_patches`` point 13).

``megatron.core.jit`` binds ``jit_fuser`` to ``torch.compile`` when it is imported, and the modules imported after it
decorate their functions with it: each decoration imports torch's compiler stack (dynamo, inductor: about 4 s of CPU
per process), for functions megarl runs eager anyway. This finder runs ``megatron.core.jit`` as it is and then calls
its own ``disable_jit_fuser()``, before any other module uses it, so no function is compiled and nothing of the
compiler is imported. No torch import here: :mod:`megarl` installs it before anything imports Megatron.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

JIT_MODULE = "megatron.core.jit"


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.disable_jit_fuser()


class EagerMegatronFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` where the path finder does and loads it with its fuser disabled."""

    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Idempotent; a no-op once ``megatron.core.jit`` is imported (``megatron_patches`` then undoes the compilation)."""
    if JIT_MODULE not in sys.modules and not any(isinstance(f, EagerMegatronFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, EagerMegatronFinder())
