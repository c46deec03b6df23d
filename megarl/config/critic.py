"""The value model (``critic.*``); :class:`megarl.workers.critic.CriticRole` takes this section as it is."""

from __future__ import annotations

import dataclasses

from megarl.algo.losses import AGG_MODES, value_loss
from megarl.config.common import check_choice, check_micro_batches, check_positive, default_of
from megarl.config.megatron import MegatronConfig
from megarl.config.model import OptimConfig
from megarl.config.parallel import ParallelDims


@dataclasses.dataclass(kw_only=True)
class CriticConfig:
    """The value model (``critic.*``); required by ``algorithm.adv_estimator=gae``."""

    enable: bool = False
    """Train a critic (PPO with GAE)."""
    model_path: str | None = None
    """HF directory the value model starts from (its LM head replaced by a value head); None: the policy's."""
    use_remove_padding: bool = True
    """Pack each micro-batch's sequences end to end (THD) in the critic's passes; false: pad them."""
    ppo_mini_batch_size: int = 256
    """Prompts per critic optimizer step (times ``rollout.n`` trajectories)."""
    ppo_micro_batch_size_per_gpu: int | None = 8
    """Trajectories per forward/backward on one rank; ignored with ``use_dynamic_bsz``."""
    forward_micro_batch_size_per_gpu: int | None = 16
    """Trajectories per ``compute_values`` forward on one rank."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by token count (``ppo_max_token_len_per_gpu``)."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one micro-batch on one rank, with ``use_dynamic_bsz``."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    shuffle: bool = False
    """Shuffle the trajectories between epochs (seeded by the step)."""
    cliprange_value: float | None = default_of(value_loss, "cliprange_value")
    """Value clipping around the old values; None: off."""
    loss_agg_mode: str = default_of(value_loss, "loss_agg_mode")
    """How token losses become one number."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule (critics learn faster than policies)."""
    parallel: ParallelDims = dataclasses.field(default_factory=ParallelDims)
    """Megatron layout of the critic."""
    param_offload: bool = False
    """Move parameters to host memory outside the update (GPU only)."""
    grad_offload: bool = False
    """Move gradient buffers to host memory outside the update (GPU only)."""
    optimizer_offload: bool = False
    """Move optimizer states to host memory outside the update (GPU only)."""
    megatron: MegatronConfig = dataclasses.field(default_factory=MegatronConfig)
    """Megatron's ``TransformerConfig`` fields passed through (``megatron.override_transformer_config.*``)."""

    def __post_init__(self) -> None:
        check_positive("critic.ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_micro_batches("critic.ppo", self.ppo_micro_batch_size_per_gpu, self.use_dynamic_bsz,
                            self.ppo_max_token_len_per_gpu)
        check_positive("critic.forward_micro_batch_size_per_gpu", self.forward_micro_batch_size_per_gpu,
                       allow_none=self.use_dynamic_bsz)
        check_positive("critic.ppo_epochs", self.ppo_epochs)
        check_positive("critic.cliprange_value", self.cliprange_value, allow_none=True)
        check_choice("critic.loss_agg_mode", self.loss_agg_mode, AGG_MODES)
