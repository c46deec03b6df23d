"""Parallel layout, process groups, CPU support, pipeline forward/backward and vocab-parallel log-probs."""

from megarl.parallel.dims import MeshAxis, ParallelDims
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
