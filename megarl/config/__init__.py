"""The run configuration: typed dataclasses (``schema``), cross-component checks (``validate``), and
composition from ``configs/`` with Hydra (``loading``)."""

from megarl.config.loading import CONFIG_DIR, ConfigError, compose_config, load_config, to_run_config
from megarl.config.schema import (
    SCHEMA_NAME,
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    CriticConfig,
    CustomRewardFunction,
    DataConfig,
    KLControlConfig,
    ModelConfig,
    MultiTurnConfig,
    ParallelConfig,
    RefConfig,
    RewardConfig,
    RolloutSection,
    RunConfig,
    TrainerConfig,
    ValKwargsSection,
    register_schema,
)
from megarl.config.validate import data_parallel_size, validate

__all__ = [
    "CONFIG_DIR", "SCHEMA_NAME", "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "ConfigError",
    "CriticConfig", "CustomRewardFunction", "DataConfig", "KLControlConfig", "ModelConfig", "MultiTurnConfig",
    "ParallelConfig", "RefConfig", "RewardConfig", "RolloutSection", "RunConfig", "TrainerConfig",
    "ValKwargsSection", "compose_config", "data_parallel_size", "load_config", "register_schema",
    "to_run_config", "validate",
]
