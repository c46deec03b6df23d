"""The colocated engines' memory between a step's phases, by SGLang's memory tags.

After generating, colocated engines give their memory to training: ``kv_cache`` and ``cuda_graph``, and
``weights`` too when a weight sync follows before the next generation (released weights hold garbage on
GPUs, so they are released only when they will be rewritten). Before a sync ``weights`` come back, after it
the rest. SGLang refuses to resume a tag it did not release, so :class:`EngineMemory` remembers what it
released and resumes exactly that; megarl's CPU engine refuses to generate from released memory, so a wrong
order fails in CI.
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.rollout.client import EngineClient, gather_sync

TRAINING_TAGS = ("kv_cache", "cuda_graph")
"""What the engines give up for every training phase (and take back after the weight sync, or after a step
without one)."""


class EngineMemory:
    """Release and resume the engines' memory by tag; ``enabled`` false (engines not colocated with training,
    or ``rollout.free_cache_engine`` off): nothing is released."""

    def __init__(self, engines: Sequence[EngineClient], *, enabled: bool) -> None:
        self.engines = list(engines)
        self.enabled = enabled
        self.released: set[str] = set()
        """The tags the engines have released and not taken back."""

    def release(self, *, weights: bool) -> None:
        """After generating: the KV cache and CUDA graphs, and the weights when a weight sync follows."""
        if not self.enabled:
            return
        tags = [*TRAINING_TAGS, *(["weights"] if weights else [])]
        gather_sync([engine.release_memory_occupation(tags) for engine in self.engines])
        self.released.update(tags)

    def resume(self, tags: Sequence[str]) -> None:
        """Take back those of ``tags`` that were released: ``weights`` before a sync, the rest after it."""
        todo = [tag for tag in tags if tag in self.released]
        if todo:
            gather_sync([engine.resume_memory_occupation(todo) for engine in self.engines])
            self.released.difference_update(todo)
