"""Rollout: generation with the engines (:mod:`megarl.engines`): the rollout manager, the multi-turn agent loop,
tools and interactions, and the asynchronous producer and its buffer.

The rollout's settings are :class:`megarl.config.RolloutConfig` (``actor_rollout_ref.rollout``). The names below are
loaded on first use: importing a light submodule does not import torch through the agent loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl._lazy import first_use

if TYPE_CHECKING:
    from megarl.rollout.agent_loop import AgentLoop
    from megarl.rollout.manager import RolloutManager
    from megarl.rollout.request_batch import batch_from_requests, requests_from_batch

_MODULES = {
    "agent_loop": ("AgentLoop",),
    "manager": ("RolloutManager",),
    "request_batch": ("batch_from_requests", "requests_from_batch"),
}
__all__ = [
    "AgentLoop",
    "RolloutManager",
    "batch_from_requests",
    "requests_from_batch",
]


__getattr__ = first_use(__name__, _MODULES, globals())
