"""The colocated engines' memory between a step's phases, by SGLang's memory tags.

After generating, colocated engines give their memory to training: ``kv_cache`` and ``cuda_graph``, and
``weights`` too when a weight sync that rewrites them follows before the next generation. SGLang's memory saver
frees released weights (megarl never starts it with ``--enable-weights-cpu-backup``) and maps fresh pages on
resume, so they hold garbage until rewritten: a LoRA run that syncs its adapters alone
(``rollout.lora_sync=adapters``) never rewrites the base, and keeps it. Before a sync ``weights`` come back, after it
the rest. SGLang refuses to resume a tag it did not release, so :class:`EngineMemory` remembers what it
released and resumes exactly that; megarl's CPU engine refuses to generate from released memory, so a wrong
order fails in CI.
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.engines.client import EngineClient, gather_sync

TRAINING_TAGS = ("kv_cache", "cuda_graph")
"""What the engines give up for every training phase (and take back after the weight sync, or after a step
without one)."""


class EngineMemory:
    """Release and resume the engines' memory by tag; ``enabled`` false (engines not colocated with training,
    or ``rollout.free_cache_engine`` off): nothing is released."""

    def __init__(self, engines: Sequence[EngineClient], *, enabled: bool, sync_rewrites_weights: bool = True) -> None:
        self.engines = list(engines)
        self.enabled = enabled
        self.sync_rewrites_weights = sync_rewrites_weights
        """Whether a weight sync rewrites every engine weight (false: the adapters alone): only then are the weights
        released before one."""
        self.released: set[str] = set()
        """The tags the engines have released and not taken back."""

    def release(self, *, weights: bool) -> None:
        """After generating: the KV cache and CUDA graphs, and the weights when a weight sync that rewrites them
        follows (``weights``: a sync follows)."""
        if not self.enabled:
            return
        tags = [*TRAINING_TAGS, *(["weights"] if weights and self.sync_rewrites_weights else [])]
        gather_sync([engine.release_memory_occupation(tags) for engine in self.engines])
        self.released.update(tags)

    def resume(self, tags: Sequence[str]) -> None:
        """Take back those of ``tags`` that were released: ``weights`` before a sync, the rest after it."""
        todo = [tag for tag in tags if tag in self.released]
        if todo:
            gather_sync([engine.resume_memory_occupation(todo) for engine in self.engines])
            self.released.difference_update(todo)
