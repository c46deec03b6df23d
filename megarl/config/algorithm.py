"""Advantages and the in-reward KL (``algorithm.*``), and rewards (``reward_model.*``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from megarl.algo.advantages import ESTIMATORS, gae_advantage, grpo_outcome_advantage
from megarl.algo.kl import KL_KINDS, build_kl_controller
from megarl.algo.rollout_correction import IS_LEVELS, parse_rs
from megarl.config.common import check_choice, check_positive, default_of
from megarl.config.judge import JudgeConfig
from megarl.config.megatron import MegatronConfig
from megarl.config.model import RewardModelSource
from megarl.config.parallel import ParallelDims
from megarl.reward.manager import ON_ERROR_MODES

KL_CTRL_TYPES = ("fixed", "adaptive")
RM_COMBINE = ("replace", "add")
"""``reward_model.combine``: how a reward model's score and the rule reward make the reward."""


@dataclasses.dataclass(kw_only=True)
class CustomRewardFunction:
    """A scoring function named by file or module (``reward_model.custom_reward_function.*``)."""

    path: str | None = None
    """Python file or dotted module holding the function; None: score with the ``data_source`` registry."""
    name: str = "compute_score"
    """Function in ``path`` with verl's signature ``(data_source, solution_str, ground_truth, extra_info)``."""
    reward_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments bound to every call."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"reward_model.custom_reward_function.name={self.name!r} is not a function name")
        if self.reward_kwargs and self.path is None:
            raise ValueError("reward_model.custom_reward_function.reward_kwargs are set but no "
                             "reward_model.custom_reward_function.path: set the path or drop the kwargs")

    def spec(self) -> str | None:
        """``"path:name"`` for :func:`megarl.reward.registry.load_function`; None without a path."""
        return None if self.path is None else f"{self.path}:{self.name}"


@dataclasses.dataclass(kw_only=True)
class OverlongBufferConfig:
    """``reward_model.overlong_buffer.*``: DAPO's soft overlong punishment (verl's dapo reward manager's
    ``overlong_buffer_cfg``). A response longer than ``data.max_response_length - len`` tokens (tool outputs
    included) has ``(length - (max - len)) / len * penalty_factor`` taken off its score (training and
    validation): ``-penalty_factor`` at the full length (:func:`megarl.algo.dapo.overlong_penalty`)."""

    enable: bool = False
    len: int = 0
    """Tokens before ``data.max_response_length`` where the penalty starts."""
    penalty_factor: float = 1.0
    """The penalty at ``data.max_response_length``."""
    log: bool = False
    """Add each row's penalty (``overlong_reward``) and whether it had one (``overlong``) to the reward's extras."""

    def __post_init__(self) -> None:
        if self.enable:
            check_positive("reward_model.overlong_buffer.len", self.len)
        if self.penalty_factor < 0:
            raise ValueError(f"reward_model.overlong_buffer.penalty_factor must be >= 0, got {self.penalty_factor}")


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
    """Rewards (``reward_model.*``): rule-based (the ``data_source`` registry or a custom function) and, with
    ``enable``, a reward model (verl's keys) that scores each response with its own model and layout."""

    enable: bool = False
    """Score each response with a reward model (``model``), combined with the rule rewards as ``combine`` says."""
    model: RewardModelSource = dataclasses.field(default_factory=RewardModelSource)
    """The reward model: an HF sequence-classification checkpoint (one label) of a family megarl serves."""
    combine: str = "replace"
    """``replace``: the reward model's score is the reward (verl's); ``add``: the rule reward plus ``rm_coef`` times
    the reward model's score."""
    rm_coef: float = 1.0
    """The reward model's weight with ``combine=add``."""
    micro_batch_size_per_gpu: int | None = 16
    """Responses per reward-model forward on one rank; ignored with ``use_dynamic_bsz``."""
    use_dynamic_bsz: bool = False
    """Pack the reward model's micro-batches by token count (``forward_max_token_len_per_gpu``)."""
    forward_max_token_len_per_gpu: int = 32768
    """Token budget of one reward-model micro-batch on one rank, with ``use_dynamic_bsz``."""
    parallel: ParallelDims = dataclasses.field(default_factory=ParallelDims)
    """Megatron layout of the reward model (its own; ``dp`` is what the world leaves)."""
    param_offload: bool = False
    """Keep the reward model's weights in host memory between its forwards (GPU only)."""
    megatron: MegatronConfig = dataclasses.field(default_factory=MegatronConfig)
    """Megatron's ``TransformerConfig`` fields passed through (``megatron.override_transformer_config.*``)."""
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)
    """A generative judge (an LLM on engines of its own) scoring every trajectory (:mod:`megarl.config.judge`)."""

    custom_reward_function: CustomRewardFunction = dataclasses.field(default_factory=CustomRewardFunction)
    """A custom scoring function replacing the registry."""
    overlong_buffer: OverlongBufferConfig = dataclasses.field(default_factory=OverlongBufferConfig)
    """DAPO's soft overlong punishment."""
    scorer_kwargs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per ``data_source`` settings of registered scorers, e.g. ``{"openai/gsm8k": {"method": "flexible"}}``."""
    num_examine: int = 0
    """Decoded samples per ``data_source`` logged per training step."""
    on_error: str = "raise"
    """A row the reward function cannot score (it raises, or returns no finite score): ``raise`` stops the run
    naming the row, its data source and the function; ``skip`` scores it 0, leaves it out of the update (and out
    of validation means) and counts it (``reward/num_errors``)."""
    timeout_s: float | None = 300.0
    """The longest one row's scoring may take; past it the row is an error as ``on_error`` says, naming the row.
    The function then runs on a thread of the reward manager's; null: no limit, on the trainer's thread."""

    def __post_init__(self) -> None:
        if self.num_examine < 0:
            raise ValueError(f"reward_model.num_examine must be >= 0, got {self.num_examine}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"reward_model.timeout_s must be > 0 seconds (or null for no limit), got "
                             f"{self.timeout_s}")
        check_choice("reward_model.on_error", self.on_error, ON_ERROR_MODES)
        check_choice("reward_model.combine", self.combine, RM_COMBINE)
        if self.enable:
            if not self.model.path:
                raise ValueError("reward_model.enable=true needs reward_model.model.path: the reward model's HF "
                                 "sequence-classification directory")
            if self.micro_batch_size_per_gpu is None and not self.use_dynamic_bsz:
                raise ValueError("reward_model.micro_batch_size_per_gpu=null: set it to a positive number of rows, "
                                 "or turn on reward_model.use_dynamic_bsz")
            check_positive("reward_model.micro_batch_size_per_gpu", self.micro_batch_size_per_gpu, allow_none=True)
            check_positive("reward_model.forward_max_token_len_per_gpu", self.forward_max_token_len_per_gpu)


@dataclasses.dataclass(kw_only=True)
class KLControlConfig:
    """The in-reward KL coefficient's controller (``algorithm.kl_ctrl.*``)."""

    type: str = default_of(build_kl_controller, "type")
    """``fixed`` or ``adaptive``."""
    kl_coef: float = default_of(build_kl_controller, "kl_coef")
    """Initial (fixed: constant) coefficient beta."""
    target_kl: float = default_of(build_kl_controller, "target_kl")
    """KL the adaptive controller aims for."""
    horizon: float = default_of(build_kl_controller, "horizon")
    """Adaptive controller's horizon in trajectories."""

    def __post_init__(self) -> None:
        check_choice("algorithm.kl_ctrl.type", self.type, KL_CTRL_TYPES)
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {self.kl_coef}")
        check_positive("algorithm.kl_ctrl.target_kl", self.target_kl)
        check_positive("algorithm.kl_ctrl.horizon", self.horizon)


@dataclasses.dataclass(kw_only=True)
class FilterGroupsConfig:
    """``algorithm.filter_groups.*``: DAPO's dynamic sampling (verl's names). A prompt whose ``n`` samples all have
    the same ``metric`` has zero GRPO advantage: its group is left out (counted) and more prompts are generated
    until a step has ``data.train_batch_size`` groups with signal; synchronous and asynchronous runs alike."""

    enable: bool = False
    metric: str = "seq_final_reward"
    """What must differ within a group: ``seq_final_reward`` / ``seq_reward`` (the sequence's score; equal, since
    the in-reward KL is off under filtering) or a per-row number the reward function returns (e.g. ``acc``)."""
    max_num_gen_batches: int = 0
    """Most generation batches (of ``data.train_batch_size`` prompts) one step may use; 0: no bound."""

    def __post_init__(self) -> None:
        if self.max_num_gen_batches < 0:
            raise ValueError(f"algorithm.filter_groups.max_num_gen_batches must be >= 0 (0: no bound), got "
                             f"{self.max_num_gen_batches}")
        if not self.metric:
            raise ValueError("algorithm.filter_groups.metric must name a reward: seq_final_reward, seq_reward or a "
                             "per-row number of the reward function (e.g. acc)")


@dataclasses.dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction.*`` (verl's names): importance weights and rejection of the tokens or
    sequences whose rollout policy is too far from the training policy (:mod:`megarl.algo.rollout_correction`);
    off unless ``rollout_is`` or ``rollout_rs`` is set. Needs the engines' log-probs."""

    rollout_is: str | None = None
    """``token`` or ``sequence`` truncated importance weights ``π_old / π_rollout`` on the policy loss; null: none."""
    rollout_is_threshold: float = 2.0
    """Their upper truncation."""
    rollout_is_batch_normalize: bool = False
    """Scale the weights to mean 1 over the batch's tokens (sequences)."""
    rollout_rs: str | None = None
    """Rejection statistics, comma-separated (``token_k1`` is IcePop's two-sided token mask, ``seq_mean_k1`` bounds
    the geometric mean ratio; ``token_k2``/``k3``, ``seq_sum_*``, ``seq_mean_*``, ``seq_max_k2``/``k3``); null: none."""
    rollout_rs_threshold: str | None = None
    """Per option (or one for all), comma-separated: ``lower_upper`` ratio bounds for ``k1`` options (one number
    ``u``: ``1/u`` to ``u``), an upper bound for ``k2``/``k3`` ones."""

    def __post_init__(self) -> None:
        p = "algorithm.rollout_correction"
        if self.rollout_is is not None:
            check_choice(f"{p}.rollout_is", self.rollout_is, IS_LEVELS)
        check_positive(f"{p}.rollout_is_threshold", self.rollout_is_threshold)
        self.rejection  # the options and thresholds, checked

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or bool(self.rollout_rs)

    @property
    def rejection(self) -> list[tuple[str, float | None, float]]:
        """``(option, lower, upper)`` of each rejection statistic (:func:`megarl.algo.rollout_correction.parse_rs`)."""
        return parse_rs(self.rollout_rs, self.rollout_rs_threshold)


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantages and the in-reward KL (``algorithm.*``)."""

    adv_estimator: str = "grpo"
    """Advantage estimator (``megarl.algo.advantages.ESTIMATORS``); ``gae`` needs the critic."""
    gamma: float = default_of(gae_advantage, "gamma")
    """Discount factor."""
    lam: float = default_of(gae_advantage, "lam")
    """GAE's lambda."""
    whiten: bool = default_of(gae_advantage, "whiten")
    """Whiten GAE advantages over the batch."""
    norm_adv_by_std_in_grpo: bool = default_of(grpo_outcome_advantage, "norm_adv_by_std_in_grpo")
    """Divide GRPO advantages by the group's std (False: Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract ``beta * KL(pi_old || pi_ref)`` from the token rewards; needs the reference model."""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty (``megarl.algo.kl.KL_KINDS``)."""
    kl_ctrl: KLControlConfig = dataclasses.field(default_factory=KLControlConfig)
    """The in-reward KL coefficient's controller."""
    filter_groups: FilterGroupsConfig = dataclasses.field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection against the rollout/training mismatch."""

    def __post_init__(self) -> None:
        check_choice("algorithm.adv_estimator", self.adv_estimator, tuple(sorted(ESTIMATORS)))
        check_choice("algorithm.kl_penalty", self.kl_penalty, KL_KINDS)
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"algorithm.gamma must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"algorithm.lam must be in [0, 1], got {self.lam}")
        if self.filter_groups.enable and self.use_kl_in_reward:
            raise ValueError("algorithm.filter_groups.enable=true with algorithm.use_kl_in_reward=true: groups are "
                             "filtered on their scores before the reference model runs; use the KL loss "
                             "(actor_rollout_ref.actor.use_kl_loss) instead, as DAPO does")
