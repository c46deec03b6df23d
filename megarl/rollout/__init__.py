"""Rollout: engine protocol, the HTTP client of engine servers, rollout manager, multi-turn agent loop, tools.

An engine replica is a server process speaking SGLang's HTTP API (``sglang.launch_server`` on
GPUs; megarl's CPU engine server, the subpackage :mod:`megarl.rollout.cpu_engine`, in CI; nothing else here
imports it),
with sglang-router (:mod:`megarl.rollout.router`) in front for generation; :class:`EngineClient`
is the one client of that API. The rollout's settings are :class:`megarl.config.RolloutConfig`
(``actor_rollout_ref.rollout``).
"""

from megarl.rollout.agent_loop import AgentLoop, batch_from_requests, requests_from_batch
from megarl.rollout.client import EngineClient, EngineError
from megarl.rollout.engine import (
    FinishReason,
    GenerateOutput,
    RolloutEngine,
    SamplingParams,
    update_weights,
    weight_update_session,
)
from megarl.rollout.manager import RolloutManager

__all__ = [
    "AgentLoop",
    "EngineClient",
    "EngineError",
    "FinishReason",
    "GenerateOutput",
    "RolloutEngine",
    "RolloutManager",
    "SamplingParams",
    "batch_from_requests",
    "requests_from_batch",
    "update_weights",
    "weight_update_session",
]
