"""The run configuration: one typed, ``kw_only`` dataclass per component, registered with Hydra.

Layout (verl's key names), each section defined in the module named after it::

    RunConfig
      recipe                      name of the recipe that produced this config
      data                        DataConfig                     (config/data.py)
      actor_rollout_ref
        hybrid_engine             actor and rollout engines share GPUs
        model                     ModelConfig                    (config/model.py)
        actor                     ActorConfig (optim: OptimConfig, parallel: ParallelDims,   (config/actor.py)
                                  router_replay: RouterReplayConfig, megatron: MegatronConfig (config/megatron.py))
        ref                       RefConfig                      (config/actor.py)
        rollout                   RolloutConfig (val_kwargs, multi_turn)                     (config/rollout.py)
      critic                      CriticConfig (optim, parallel, megatron)                   (config/critic.py)
      teacher                     TeacherConfig (model: ScoringModelConfig, parallel, megatron)  (config/teacher.py)
      reward_model                RewardConfig                   (config/algorithm.py)
      algorithm                   AlgorithmConfig (kl_ctrl)      (config/algorithm.py)
      trainer                     TrainerConfig (links: LinksConfig)                         (config/trainer.py)
      async_training              AsyncTrainingConfig                                        (config/async_training.py)
      generation                  GenerationConfig (megarl-generate)                         (config/generation.py)

Defaults live in these dataclasses only (or, where a lower component owns a default, are read from it
with :func:`megarl.config.common.default_of`). The code that uses a section receives the section
itself (over Ray too): no field is repeated in a second dataclass. Each ``__post_init__`` checks its own
fields; checks that span sections are in :func:`megarl.config.checks.validate`, which
:func:`megarl.config.load_config` runs once. The YAML under ``configs/`` only selects a recipe and
overrides values.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megarl.config.actor import ActorConfig, RefConfig
from megarl.config.algorithm import AlgorithmConfig, RewardConfig
from megarl.config.async_training import AsyncTrainingConfig
from megarl.config.critic import CriticConfig
from megarl.config.data import DataConfig
from megarl.config.generation import GenerationConfig
from megarl.config.model import ModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.teacher import TeacherConfig
from megarl.config.trainer import TrainerConfig

SCHEMA_NAME = "megarl_run_schema"
"""Name of :class:`RunConfig` in Hydra's ConfigStore; ``configs/config.yaml`` lists it first."""


@dataclasses.dataclass(kw_only=True)
class ActorRolloutRefConfig:
    """The policy and what shares its weights (``actor_rollout_ref.*``)."""

    hybrid_engine: bool = True
    """Colocate the rollout engines with the actor on the same GPUs (engines release memory during training)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy model."""
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    """The policy's training."""
    ref: RefConfig = dataclasses.field(default_factory=RefConfig)
    """The frozen reference policy."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Generation engines and sampling."""


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """One training run. Build it with :func:`megarl.config.load_config` (which validates it)."""

    recipe: str = "custom"
    """Name of the recipe (``configs/recipe/<name>.yaml``) this config came from."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompt data."""
    actor_rollout_ref: ActorRolloutRefConfig = dataclasses.field(default_factory=ActorRolloutRefConfig)
    """The policy, its reference and its rollout engines."""
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    """The value model."""
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    """A teacher scoring the policy's samples (on-policy distillation)."""
    reward_model: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """Rewards."""
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """Advantages and the in-reward KL."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """Length, machines, checkpoints, logging."""
    async_training: AsyncTrainingConfig = dataclasses.field(default_factory=AsyncTrainingConfig)
    """Bounds of asynchronous training (``trainer.mode``)."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    """``megarl-generate``'s output (generation only; training ignores it)."""

    @property
    def needs_ref(self) -> bool:
        """A reference model is needed when a KL term is on (the KL loss or the in-reward KL)."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def rollout_widths(self) -> tuple[int, int]:
        """``(P, R)``: ``rollout.prompt_length`` / ``response_length``, defaulting to ``data.max_*_length``."""
        rollout = self.actor_rollout_ref.rollout
        return (rollout.prompt_length or self.data.max_prompt_length,
                rollout.response_length or self.data.max_response_length)

    @property
    def lora_syncs_adapters(self) -> bool:
        """A LoRA run whose weight sync loads the adapters alone into engines serving LoRA
        (``rollout.lora_sync=adapters``): the engines launch with LoRA on, and every request names the adapter."""
        return bool(self.actor_rollout_ref.model.lora_rank) and self.actor_rollout_ref.rollout.lora_sync == "adapters"

    @property
    def engine_tp(self) -> int:
        """GPUs per rollout engine: 1 for the (unsharded) ``hf`` engine, else ``rollout.tensor_model_parallel_size``
        or the actor's TP (TP-matched engines)."""
        rollout = self.actor_rollout_ref.rollout
        if rollout.name == "hf":
            return 1
        return rollout.tensor_model_parallel_size or self.actor_rollout_ref.actor.parallel.tp

    @property
    def run_dir(self) -> Path:
        """The run's directory: ``trainer.default_local_dir / project_name / experiment_name`` (its checkpoints)."""
        trainer = self.trainer
        return Path(trainer.default_local_dir).expanduser() / trainer.project_name / trainer.experiment_name

    @property
    def rollout_seed(self) -> int:
        """Base seed of the engines' sampling: ``rollout.seed``, else ``trainer.seed``."""
        seed = self.actor_rollout_ref.rollout.seed
        return self.trainer.seed if seed is None else seed


def register_schema() -> None:
    """Register :class:`RunConfig` in Hydra's ConfigStore as :data:`SCHEMA_NAME` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)
