"""The policy's training (``actor_rollout_ref.actor.*``) and the frozen reference (``actor_rollout_ref.ref.*``).

:class:`megarl.workers.actor.ActorRole` and the actor's Ray worker take these sections as
they are; nothing repeats their fields.
"""

from __future__ import annotations

import dataclasses

from megarl.algo.kl import KL_KINDS
from megarl.algo.losses import AGG_MODES, POLICY_LOSS_MODES, policy_loss
from megarl.algo.mismatch import TIS_LEVELS, tis_weights
from megarl.config.common import check_choice, check_micro_batches, check_positive, default_of
from megarl.config.megatron import MegatronConfig
from megarl.config.model import OptimConfig
from megarl.config.parallel import ParallelDims

RECOMPUTE_GRANULARITIES = ("full", "selective")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss")


ROUTER_REPLAY_MODES = ("off", "compare", "replay")


@dataclasses.dataclass(kw_only=True)
class RouterReplayConfig:
    """Routing replay for mixture-of-experts policies (``actor_rollout_ref.actor.router_replay.*``).

    The engines return the experts they routed every token to (SGLang's ``return_routed_experts``, its servers
    launched with ``--enable-return-routed-experts``); ``replay`` makes the actor's routers use them in the
    old-log-prob, reference and update passes (Megatron-Core's RouterReplay), so the training pass computes the
    log-probs of the experts that generated each token; ``compare`` keeps the actor's own routing and reports how
    far it is from the rollout's; both report ``moe/routing_mismatch`` (the fraction of (token, MoE layer) routings
    of the old-log-prob pass that differ from the rollout's: 0 under replay) and ``moe/router_natural_mismatch``
    (those the actor's routers would choose differently by themselves)."""

    mode: str = "off"
    """``off``, ``compare`` or ``replay``."""

    def __post_init__(self) -> None:
        check_choice("actor_rollout_ref.actor.router_replay.mode", self.mode, ROUTER_REPLAY_MODES)

    @property
    def enabled(self) -> bool:
        """The engines return routed experts (``compare`` or ``replay``)."""
        return self.mode != "off"

    @property
    def replay(self) -> bool:
        return self.mode == "replay"


@dataclasses.dataclass(kw_only=True)
class ActorConfig:
    """The policy's training (``actor_rollout_ref.actor.*``)."""

    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (times ``rollout.n`` trajectories), over all data-parallel ranks."""
    ppo_micro_batch_size_per_gpu: int | None = 8
    """Trajectories per forward/backward on one rank; ignored with ``use_dynamic_bsz``."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by token count (``ppo_max_token_len_per_gpu``) instead of a fixed row count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch on one rank, with ``use_dynamic_bsz``."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    shuffle: bool = False
    """Shuffle the trajectories between epochs (seeded by the step)."""
    policy_loss_mode: str = default_of(policy_loss, "policy_loss_mode")
    """Surrogate: ``vanilla`` (PPO clip) or ``gspo``."""
    clip_ratio: float = default_of(policy_loss, "clip_ratio_low")
    """Symmetric PPO clip (verl's ``clip_ratio``, 0.2): used for ``clip_ratio_low`` / ``clip_ratio_high`` left unset."""
    clip_ratio_low: float | None = None
    """Lower clip: the ratio is clipped at ``1 - clip_ratio_low``; None: clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip: the ratio is clipped at ``1 + clip_ratio_high`` (DAPO clip-higher if larger); None: clip_ratio."""
    clip_ratio_c: float | None = default_of(policy_loss, "clip_ratio_c")
    """Dual-clip bound for negative advantages (> 1); None turns dual clip off."""
    loss_agg_mode: str = default_of(policy_loss, "loss_agg_mode")
    """How token losses become one number (``megarl.algo.losses.AGG_MODES``)."""
    entropy_coeff: float = default_of(policy_loss, "entropy_coeff")
    """Weight of the entropy bonus (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(pi || pi_ref)`` to the loss; needs the reference model."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss, with ``use_kl_loss``."""
    kl_loss_type: str = default_of(policy_loss, "kl_loss_type")
    """KL estimator of the KL loss (``megarl.algo.kl.KL_KINDS``)."""
    tis_cap: float | None = None
    """Truncated importance sampling against the rollout log-probs, capped here; None: off."""
    tis_level: str = default_of(tis_weights, "level")
    """``token`` or ``sequence`` importance ratios, with ``tis_cap``."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    parallel: ParallelDims = dataclasses.field(default_factory=ParallelDims)
    """Megatron layout of the actor (the reference shares it)."""
    recompute_granularity: str | None = None
    """Activation recomputation: ``full``, ``selective`` or None (off)."""
    recompute_num_layers: int = 1
    """Layers per recomputed block with ``recompute_granularity=full``."""
    param_offload: bool = False
    """Move parameters to host memory outside the update (GPU only)."""
    grad_offload: bool = False
    """Move gradient buffers to host memory outside the update (GPU only)."""
    optimizer_offload: bool = False
    """Move optimizer states to host memory outside the update (GPU only)."""
    megatron: MegatronConfig = dataclasses.field(default_factory=MegatronConfig)
    """Megatron's ``TransformerConfig`` fields passed through (``megatron.override_transformer_config.*``)."""
    router_replay: RouterReplayConfig = dataclasses.field(default_factory=RouterReplayConfig)
    """Mixture-of-experts policies: replay (or compare with) the rollout engines' routing."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts policies: weight of the load-balancing loss (Megatron's ``moe_aux_loss_coeff``; 0: off).
    It enters as its mean over the step's micro-batches and data-parallel ranks, whatever their token counts."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts policies: weight of the router z-loss (ST-MoE; Megatron's ``moe_z_loss_coeff``; 0: off),
    normalised as the load-balancing loss."""
    moe_load_balancing_type: str = "aux_loss"
    """The load-balancing loss: ``aux_loss`` (GShard/Switch, over each micro-batch's tokens) or ``seq_aux_loss``
    (DeepSeek-V2/V3, per sequence)."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.actor"
        check_positive(f"{p}.ppo_mini_batch_size", self.ppo_mini_batch_size)
        check_micro_batches(f"{p}.ppo", self.ppo_micro_batch_size_per_gpu, self.use_dynamic_bsz,
                            self.ppo_max_token_len_per_gpu)
        check_positive(f"{p}.ppo_epochs", self.ppo_epochs)
        check_choice(f"{p}.policy_loss_mode", self.policy_loss_mode, POLICY_LOSS_MODES)
        check_choice(f"{p}.loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        check_choice(f"{p}.kl_loss_type", self.kl_loss_type, KL_KINDS)
        check_choice(f"{p}.tis_level", self.tis_level, TIS_LEVELS)
        check_positive(f"{p}.tis_cap", self.tis_cap, allow_none=True)
        low, high = self.clip_range
        low_key = f"{p}.clip_ratio_low" if self.clip_ratio_low is not None else f"{p}.clip_ratio (clip_ratio_low: null)"
        high_key = (f"{p}.clip_ratio_high" if self.clip_ratio_high is not None
                    else f"{p}.clip_ratio (clip_ratio_high: null)")
        if not 0 <= low < 1:
            raise ValueError(f"{low_key} must be in [0, 1) (the ratio is clipped at 1 - it), got {low}")
        if not high >= 0:
            raise ValueError(f"{high_key} must be >= 0 (the ratio is clipped at 1 + it), got {high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"{p}.clip_ratio_c={self.clip_ratio_c} must be > 1 (or null to turn dual clip off)")
        if self.kl_loss_coef < 0:
            raise ValueError(f"{p}.kl_loss_coef must be >= 0, got {self.kl_loss_coef}")
        if self.recompute_granularity is not None:
            check_choice(f"{p}.recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        check_positive(f"{p}.recompute_num_layers", self.recompute_num_layers)
        check_choice(f"{p}.moe_load_balancing_type", self.moe_load_balancing_type, MOE_LOAD_BALANCING_TYPES)
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, key) < 0:
                raise ValueError(f"{p}.{key} must be >= 0 (0 turns it off), got {getattr(self, key)}")

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(low, high)`` clip ratios in use: ``clip_ratio_low`` / ``clip_ratio_high``, each ``clip_ratio`` when None.

        As verl: ``clip_ratio_low if clip_ratio_low is not None else clip_ratio``, the same for high.
        """
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high


@dataclasses.dataclass(kw_only=True)
class RefConfig:
    """The frozen reference policy (``actor_rollout_ref.ref.*``); used when a KL term is on.

    The reference takes the actor's Megatron layout (``actor.parallel``): it lives on the same
    ranks and loads the same shards.
    """

    log_prob_micro_batch_size_per_gpu: int | None = 16
    """Trajectories per forward on one rank; ignored with ``log_prob_use_dynamic_bsz``."""
    log_prob_use_dynamic_bsz: bool = False
    """Pack forward micro-batches by token count (``log_prob_max_token_len_per_gpu``)."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one forward micro-batch on one rank, with ``log_prob_use_dynamic_bsz``."""
    param_offload: bool = False
    """Keep the reference weights in host memory between its forwards (GPU only)."""

    def __post_init__(self) -> None:
        check_micro_batches("actor_rollout_ref.ref.log_prob", self.log_prob_micro_batch_size_per_gpu,
                            self.log_prob_use_dynamic_bsz, self.log_prob_max_token_len_per_gpu)
