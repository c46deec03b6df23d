"""The run configuration: one typed dataclass per component (``schema`` lists them), cross-component checks
(``validate``), and composition from ``configs/`` with Hydra (``loading``)."""

from megarl.config.actor import ActorConfig, RefConfig, RouterReplayConfig
from megarl.config.algorithm import AlgorithmConfig, CustomRewardFunction, KLControlConfig, RewardConfig
from megarl.config.critic import CriticConfig
from megarl.config.data import DataConfig
from megarl.config.loading import CONFIG_DIR, ConfigError, compose_config, load_config, to_run_config
from megarl.config.model import ModelConfig, OptimConfig
from megarl.config.parallel import Coordinates, MeshAxis, ParallelDims
from megarl.config.rollout import MultiTurnConfig, RolloutConfig, ValKwargs
from megarl.config.schema import SCHEMA_NAME, ActorRolloutRefConfig, RunConfig, register_schema
from megarl.config.trainer import TrainerConfig
from megarl.config.validate import data_parallel_size, validate

__all__ = [
    "CONFIG_DIR", "SCHEMA_NAME", "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "ConfigError",
    "Coordinates", "CriticConfig", "CustomRewardFunction", "DataConfig", "KLControlConfig", "MeshAxis", "ModelConfig",
    "MultiTurnConfig", "OptimConfig", "ParallelDims", "RefConfig", "RewardConfig", "RolloutConfig", "RouterReplayConfig", "RunConfig",
    "TrainerConfig", "ValKwargs", "compose_config", "data_parallel_size", "load_config", "register_schema",
    "to_run_config", "validate",
]
