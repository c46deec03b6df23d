"""The run configuration: one typed dataclass per component (``schema`` lists them), cross-component checks
(``checks``), and composition from ``configs/`` with Hydra (``loading``).

The names below are loaded on first use, so a process that needs one component's settings (an engine server's
owner: ``rollout`` and ``model``) does not import the others (``actor`` and ``algorithm`` import torch through the
defaults they read from :mod:`megarl.algo`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl._lazy import first_use

if TYPE_CHECKING:
    from megarl.config.actor import ActorConfig, RefConfig, RouterReplayConfig
    from megarl.config.algorithm import AlgorithmConfig, CustomRewardFunction, KLControlConfig, RewardConfig
    from megarl.config.checks import data_parallel_size, validate
    from megarl.config.critic import CriticConfig
    from megarl.config.data import DataConfig
    from megarl.config.loading import CONFIG_DIR, ConfigError, compose_config, load_config, to_run_config
    from megarl.config.model import ModelConfig, OptimConfig
    from megarl.config.parallel import Coordinates, MeshAxis, ParallelDims
    from megarl.config.rollout import MultiTurnConfig, RolloutConfig, ValKwargs
    from megarl.config.schema import SCHEMA_NAME, ActorRolloutRefConfig, RunConfig, register_schema
    from megarl.config.trainer import TrainerConfig

_MODULES = {
    "actor": ("ActorConfig", "RefConfig", "RouterReplayConfig"),
    "algorithm": ("AlgorithmConfig", "CustomRewardFunction", "KLControlConfig", "RewardConfig"),
    "critic": ("CriticConfig",),
    "data": ("DataConfig",),
    "loading": ("CONFIG_DIR", "ConfigError", "compose_config", "load_config", "to_run_config"),
    "model": ("ModelConfig", "OptimConfig"),
    "parallel": ("Coordinates", "MeshAxis", "ParallelDims"),
    "rollout": ("MultiTurnConfig", "RolloutConfig", "ValKwargs"),
    "schema": ("SCHEMA_NAME", "ActorRolloutRefConfig", "RunConfig", "register_schema"),
    "trainer": ("TrainerConfig",),
    "checks": ("data_parallel_size", "validate"),
}
__all__ = [
    "CONFIG_DIR", "SCHEMA_NAME", "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "ConfigError",
    "Coordinates", "CriticConfig", "CustomRewardFunction", "DataConfig", "KLControlConfig", "MeshAxis", "ModelConfig",
    "MultiTurnConfig", "OptimConfig", "ParallelDims", "RefConfig", "RewardConfig", "RolloutConfig",
    "RouterReplayConfig", "RunConfig", "TrainerConfig", "ValKwargs", "compose_config", "data_parallel_size",
    "load_config", "register_schema", "to_run_config", "validate",
]


__getattr__ = first_use(__name__, _MODULES, globals())
