"""Parallel layout, process groups, CPU support, pipeline forward/backward, vocab-parallel log-probs
and the local rank launcher (:mod:`megarl.parallel.launch`).

The names below are loaded on first use, so importing a light submodule (``launch``, which every
spawned rank imports before anything else) does not import torch or Megatron.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megarl.config.parallel import MeshAxis, ParallelDims
    from megarl.parallel.groups import ProcessGroups, destroy_parallel, init_parallel, set_seed
    from megarl.parallel.logprob import vocab_parallel_logprobs
    from megarl.parallel.pipeline import forward_backward

__all__ = [
    "MeshAxis",
    "ParallelDims",
    "ProcessGroups",
    "destroy_parallel",
    "forward_backward",
    "init_parallel",
    "set_seed",
    "vocab_parallel_logprobs",
]


def __getattr__(name: str) -> Any:
    if name in ("MeshAxis", "ParallelDims"):
        from megarl.config import parallel as module
    elif name in ("ProcessGroups", "destroy_parallel", "init_parallel", "set_seed"):
        from megarl.parallel import groups as module
    elif name == "vocab_parallel_logprobs":
        from megarl.parallel import logprob as module
    elif name == "forward_backward":
        from megarl.parallel import pipeline as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value
