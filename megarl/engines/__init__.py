"""Engines: the inference servers a run generates with, and everything that speaks to them.

An engine replica is a server process speaking SGLang's HTTP API (``sglang.launch_server`` on GPUs; megarl's CPU
engine server, the subpackage :mod:`megarl.engines.cpu_engine`, in CI and on a laptop; nothing else here imports it),
with sglang-router (:mod:`megarl.engines.router`) in front for generation. :class:`EngineClient` is the one client
of that API (its wire format: :mod:`megarl.engines.http_api`; a LoRA run's adapters on it:
:mod:`megarl.engines.lora_wire`; the process group a distributed weight sync joins: :mod:`megarl.engines.weight_group`);
:mod:`megarl.engines.server_process` starts and stops a server process; :mod:`megarl.engines.event_loop` is the
process's one event loop the clients' sessions live on. What generates *with* the engines (the rollout manager, the
agent loop, tools, the asynchronous producer) is :mod:`megarl.rollout`; a run's running set of engines behind a
router is a fleet (:class:`megarl.controller.fleet.EngineFleet`).

The names below are loaded on first use: a light submodule (``http_api``, ``server_process``, which an engine
server's owner imports) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl._lazy import first_use

if TYPE_CHECKING:
    from megarl.engines.client import EngineClient, EngineError
    from megarl.engines.engine import (
        FinishReason,
        GenerateOutput,
        RolloutEngine,
        SamplingParams,
        update_weights,
        weight_update_session,
    )

_MODULES = {
    "client": ("EngineClient", "EngineError"),
    "engine": ("FinishReason", "GenerateOutput", "RolloutEngine", "SamplingParams", "update_weights",
               "weight_update_session"),
}
__all__ = [
    "EngineClient",
    "EngineError",
    "FinishReason",
    "GenerateOutput",
    "RolloutEngine",
    "SamplingParams",
    "update_weights",
    "weight_update_session",
]


__getattr__ = first_use(__name__, _MODULES, globals())
