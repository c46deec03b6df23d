"""Rollout: engine protocol, engines, rollout manager, multi-turn agent loop, tools.

``SGLangEngine`` is imported from ``megarl.rollout.sglang_engine`` (it needs sglang). The rollout's
settings are :class:`megarl.config.RolloutConfig` (``actor_rollout_ref.rollout``).
"""

from megarl.rollout.agent_loop import AgentLoop, batch_from_requests, requests_from_batch
from megarl.rollout.engine import (
    FinishReason,
    GenerateOutput,
    RolloutEngine,
    SamplingParams,
    update_weights,
    weight_update_session,
)
from megarl.rollout.hf_engine import HFEngine
from megarl.rollout.manager import RolloutManager

__all__ = [
    "AgentLoop",
    "FinishReason",
    "GenerateOutput",
    "HFEngine",
    "RolloutEngine",
    "RolloutManager",
    "SamplingParams",
    "batch_from_requests",
    "requests_from_batch",
    "update_weights",
    "weight_update_session",
]
