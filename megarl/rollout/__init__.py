"""Rollout: engine protocol, the HTTP client of engine servers, rollout manager, multi-turn agent loop, tools.

An engine replica is a server process speaking SGLang's HTTP API (``sglang.launch_server`` on
GPUs; megarl's CPU engine server, the subpackage :mod:`megarl.rollout.cpu_engine`, in CI; nothing else here
imports it),
with sglang-router (:mod:`megarl.rollout.router`) in front for generation; :class:`EngineClient`
is the one client of that API. The rollout's settings are :class:`megarl.config.RolloutConfig`
(``actor_rollout_ref.rollout``).

The names below are loaded on first use: a light submodule (``http_api``, ``server_process``, which an engine
server's owner imports) does not import torch through the agent loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl._lazy import first_use

if TYPE_CHECKING:
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

_MODULES = {
    "agent_loop": ("AgentLoop", "batch_from_requests", "requests_from_batch"),
    "client": ("EngineClient", "EngineError"),
    "engine": ("FinishReason", "GenerateOutput", "RolloutEngine", "SamplingParams", "update_weights",
               "weight_update_session"),
    "manager": ("RolloutManager",),
}
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


__getattr__ = first_use(__name__, _MODULES, globals())
