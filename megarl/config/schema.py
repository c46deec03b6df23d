"""The run configuration: one typed, ``kw_only`` dataclass per component, registered with Hydra.

Layout (verl's key names, seeds-digest §7)::

    RunConfig
      recipe                      name of the recipe that produced this config
      data                        DataConfig
      actor_rollout_ref
        hybrid_engine             actor and rollout engines share GPUs
        model                     ModelConfig
        actor                     ActorConfig (optim: OptimConfig, parallel: ParallelConfig)
        ref                       RefConfig
        rollout                   RolloutSection (val_kwargs, multi_turn)
      critic                      CriticConfig
      reward_model                RewardConfig
      algorithm                   AlgorithmConfig (kl_ctrl)
      trainer                     TrainerConfig

Defaults live here only. Where a component already defines a setting's default (the
rollout's ``RolloutConfig``, the data set's keyword arguments, the loss functions' keyword
arguments, ...), the field takes it from there with :func:`_default` instead of repeating it.
Components whose config is already a mutable dataclass are reused as fields
(``OptimConfig``); frozen ones, which OmegaConf cannot merge into, are mirrored and rebuilt
with a ``to_<thing>()`` converter. Each ``__post_init__`` checks its own fields; checks that
span components are in :func:`megarl.config.validate.validate`. The YAML under ``configs/``
only selects a recipe and overrides values.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from omegaconf import MISSING

from megarl.algo.advantages import ESTIMATORS, gae_advantage, grpo_outcome_advantage
from megarl.algo.kl import KL_KINDS, build_kl_controller
from megarl.algo.losses import AGG_MODES, POLICY_LOSS_MODES, policy_loss, value_loss
from megarl.algo.mismatch import TIS_LEVELS, tis_weights
from megarl.data.dataset import TRUNCATION_MODES, PromptDataset
from megarl.parallel.dims import ParallelDims
from megarl.rollout.agent_loop import AgentLoopConfig
from megarl.rollout.manager import RolloutConfig, ValKwargs
from megarl.rollout.request import SANITY_CHECK_MODES
from megarl.rollout.tool_parser import PARSERS
from megarl.workers.megatron_engine import OptimConfig

SCHEMA_NAME = "megarl_run_schema"
"""Name of :class:`RunConfig` in Hydra's ConfigStore; ``configs/config.yaml`` lists it first."""

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
ROLLOUT_NAMES = ("hf", "sglang")
MODEL_INITS = ("pretrained", "tiny_sft")
RESUME_MODES = ("auto", "disable", "resume_path")
LOGGERS = ("console", "tensorboard", "jsonl")
RECOMPUTE_GRANULARITIES = ("full", "selective")
KL_CTRL_TYPES = ("fixed", "adaptive")


def _default(owner: Any, name: str) -> Any:
    """The default of ``name`` in ``owner``: a dataclass field, or a function/constructor keyword argument."""
    if dataclasses.is_dataclass(owner):
        field = {f.name: f for f in dataclasses.fields(owner)}[name]
        if field.default is not dataclasses.MISSING:
            return field.default
        return field.default_factory()
    return inspect.signature(owner).parameters[name].default


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} is unknown; use one of {list(choices)}")


def _check_positive(key: str, value: int | float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")


# --------------------------------------------------------------------------------------------- data


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Prompt data (``data.*``); the data-set keys are :class:`megarl.data.PromptDataset`'s keyword arguments."""

    train_files: list[str] = MISSING
    """Training parquet files (megarl's row schema, seeds-digest §2.1)."""
    val_files: list[str] = dataclasses.field(default_factory=list)
    """Validation parquet files; empty: no validation."""
    train_batch_size: int = 1024
    """Prompts per PPO iteration (each is sampled ``rollout.n`` times)."""
    val_batch_size: int | None = None
    """Prompts per validation generate call; None: the whole validation set at once."""
    max_prompt_length: int = _default(PromptDataset, "max_prompt_length")
    """Longest templated prompt in tokens; longer ones are filtered or truncated (``truncation``)."""
    max_response_length: int = _default(RolloutConfig, "response_length")
    """Longest response in tokens (the rollout's ``R``)."""
    truncation: str = _default(PromptDataset, "truncation")
    """What to do with an over-long prompt that is not filtered: ``error``, ``left``, ``right`` or ``middle``."""
    filter_overlong_prompts: bool = _default(PromptDataset, "filter_overlong_prompts")
    """Drop prompts longer than ``max_prompt_length`` when the data set is built."""
    prompt_key: str = _default(PromptDataset, "prompt_key")
    """Parquet column holding the chat messages."""
    return_raw_chat: bool = _default(PromptDataset, "return_raw_chat")
    """Keep the raw messages in the batch; multi-turn rollouts need them."""
    return_full_prompt: bool = _default(PromptDataset, "return_full_prompt")
    """Keep the templated prompt text in the batch (for logging)."""
    need_tools_kwargs: bool = _default(PromptDataset, "need_tools_kwargs")
    """Every row must carry ``extra_info.tools_kwargs`` (tool-using tasks)."""
    apply_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments of ``tokenizer.apply_chat_template``."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded by ``trainer.seed``)."""

    def __post_init__(self) -> None:
        _check_positive("data.train_batch_size", self.train_batch_size)
        _check_positive("data.val_batch_size", self.val_batch_size, allow_none=True)
        _check_positive("data.max_prompt_length", self.max_prompt_length)
        _check_positive("data.max_response_length", self.max_response_length)
        _check_choice("data.truncation", self.truncation, TRUNCATION_MODES)
        if not self.train_files:
            raise ValueError("data.train_files is empty: give at least one training parquet file")

    def dataset_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`megarl.data.PromptDataset` (besides the files and the tokenizer)."""
        return {
            "max_prompt_length": self.max_prompt_length, "truncation": self.truncation,
            "filter_overlong_prompts": self.filter_overlong_prompts, "prompt_key": self.prompt_key,
            "return_raw_chat": self.return_raw_chat, "return_full_prompt": self.return_full_prompt,
            "need_tools_kwargs": self.need_tools_kwargs,
            "apply_chat_template_kwargs": dict(self.apply_chat_template_kwargs),
        }


# ------------------------------------------------------------------------------ model and layout


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """The policy model (``actor_rollout_ref.model.*``)."""

    path: str = MISSING
    """HF model directory (or hub id already in the local cache); with ``init=tiny_sft``, where the tiny model is cached."""
    tokenizer_path: str | None = None
    """Tokenizer directory; None: ``path``."""
    init: str = "pretrained"
    """``pretrained``: load ``path``. ``tiny_sft``: build ``megarl.models.tiny``'s Qwen2 model and tokenizer,
    warm-start it by SFT on ``data.train_files`` and cache it at ``path`` (reused when present)."""
    sft_steps: int = 300
    """SFT steps of the ``tiny_sft`` warm start (at most that many when ``sft_stop_reward`` is set)."""
    sft_lr: float = 1e-3
    """Learning rate of the ``tiny_sft`` warm start."""
    sft_stop_reward: float | None = None
    """``tiny_sft``: end the SFT at the first check (every 25 steps) where the sampled (T=1) reward on the first
    256 training prompts reaches this, so GRPO starts from it; None: run all ``sft_steps``."""
    dtype: str = "bfloat16"
    """Compute dtype of the policy: ``float32``, ``bfloat16`` or ``float16`` (master weights stay fp32)."""
    trust_remote_code: bool = False
    """Allow model code from the model directory."""

    def __post_init__(self) -> None:
        _check_choice("actor_rollout_ref.model.init", self.init, MODEL_INITS)
        _check_choice("actor_rollout_ref.model.dtype", self.dtype, DTYPES)
        _check_positive("actor_rollout_ref.model.sft_steps", self.sft_steps)
        _check_positive("actor_rollout_ref.model.sft_lr", self.sft_lr)
        if self.sft_stop_reward is not None and not 0.0 < self.sft_stop_reward <= 1.0:
            raise ValueError(f"actor_rollout_ref.model.sft_stop_reward={self.sft_stop_reward!r} must be in (0, 1]; "
                             f"set it to null to run all sft_steps")


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """Megatron layout of one role (``<role>.parallel.*``); built into a :class:`ParallelDims`."""

    tp: int = _default(ParallelDims, "tp")
    """Tensor-parallel degree."""
    pp: int = _default(ParallelDims, "pp")
    """Pipeline-parallel degree."""
    cp: int = _default(ParallelDims, "cp")
    """Context-parallel degree (GPU only)."""
    dp: int | None = _default(ParallelDims, "dp")
    """Data-parallel degree; None: derived from the world size."""
    vpp: int | None = _default(ParallelDims, "vpp")
    """Virtual pipeline chunks per pipeline rank (interleaved 1F1B); None or 1: no interleaving."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside the TP group (needs ``tp > 1``)."""

    def __post_init__(self) -> None:
        self.to_dims()
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=True needs parallel.tp > 1; set it to false")

    def to_dims(self) -> ParallelDims:
        """The :class:`ParallelDims` of this layout (``dp`` still unbound when None)."""
        return ParallelDims(tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp, vpp=self.vpp)


def _check_micro_batches(prefix: str, micro_batch_size: int | None, use_dynamic_bsz: bool,
                         max_token_len: int) -> None:
    if use_dynamic_bsz:
        _check_positive(f"{prefix}_max_token_len_per_gpu", max_token_len)
    elif micro_batch_size is None or micro_batch_size < 1:
        raise ValueError(f"{prefix}_micro_batch_size_per_gpu={micro_batch_size!r}: set it to a positive number of "
                         f"rows, or turn on the token budget with the matching use_dynamic_bsz=True")


# ---------------------------------------------------------------------------------------- actor


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
    """Shuffle the trajectories between epochs."""
    policy_loss_mode: str = _default(policy_loss, "policy_loss_mode")
    """Surrogate: ``vanilla`` (PPO clip) or ``gspo``."""
    clip_ratio_low: float = _default(policy_loss, "clip_ratio_low")
    """Lower clip: the ratio is clipped at ``1 - clip_ratio_low``."""
    clip_ratio_high: float = _default(policy_loss, "clip_ratio_high")
    """Upper clip: the ratio is clipped at ``1 + clip_ratio_high`` (DAPO's clip-higher when larger)."""
    clip_ratio_c: float | None = _default(policy_loss, "clip_ratio_c")
    """Dual-clip bound for negative advantages (> 1); None turns dual clip off."""
    loss_agg_mode: str = _default(policy_loss, "loss_agg_mode")
    """How token losses become one number (``megarl.algo.losses.AGG_MODES``)."""
    entropy_coeff: float = _default(policy_loss, "entropy_coeff")
    """Weight of the entropy bonus (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add ``kl_loss_coef * KL(pi || pi_ref)`` to the loss; needs the reference model."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss, with ``use_kl_loss``."""
    kl_loss_type: str = _default(policy_loss, "kl_loss_type")
    """KL estimator of the KL loss (``megarl.algo.kl.KL_KINDS``)."""
    tis_cap: float | None = None
    """Truncated importance sampling against the rollout log-probs, capped here; None: off."""
    tis_level: str = _default(tis_weights, "level")
    """``token`` or ``sequence`` importance ratios, with ``tis_cap``."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Megatron layout of the actor."""
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

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.actor"
        _check_positive(f"{p}.ppo_mini_batch_size", self.ppo_mini_batch_size)
        _check_micro_batches(f"{p}.ppo", self.ppo_micro_batch_size_per_gpu, self.use_dynamic_bsz,
                             self.ppo_max_token_len_per_gpu)
        _check_positive(f"{p}.ppo_epochs", self.ppo_epochs)
        _check_choice(f"{p}.policy_loss_mode", self.policy_loss_mode, POLICY_LOSS_MODES)
        _check_choice(f"{p}.loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        _check_choice(f"{p}.kl_loss_type", self.kl_loss_type, KL_KINDS)
        _check_choice(f"{p}.tis_level", self.tis_level, TIS_LEVELS)
        _check_positive(f"{p}.tis_cap", self.tis_cap, allow_none=True)
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(f"{p}.clip_ratio_low must be in [0, 1) and {p}.clip_ratio_high >= 0, got "
                             f"{self.clip_ratio_low} and {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"{p}.clip_ratio_c={self.clip_ratio_c} must be > 1 (or null to turn dual clip off)")
        if self.kl_loss_coef < 0:
            raise ValueError(f"{p}.kl_loss_coef must be >= 0, got {self.kl_loss_coef}")
        if self.recompute_granularity is not None:
            _check_choice(f"{p}.recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        _check_positive(f"{p}.recompute_num_layers", self.recompute_num_layers)


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
        _check_micro_batches("actor_rollout_ref.ref.log_prob", self.log_prob_micro_batch_size_per_gpu,
                             self.log_prob_use_dynamic_bsz, self.log_prob_max_token_len_per_gpu)


# -------------------------------------------------------------------------------------- rollout


@dataclasses.dataclass(kw_only=True)
class ValKwargsSection:
    """Validation sampling (``actor_rollout_ref.rollout.val_kwargs.*``), built into :class:`ValKwargs`."""

    temperature: float = _default(ValKwargs, "temperature")
    """0 means greedy."""
    top_p: float = _default(ValKwargs, "top_p")
    """Nucleus sampling mass."""
    top_k: int = _default(ValKwargs, "top_k")
    """-1 disables top-k."""
    do_sample: bool = _default(ValKwargs, "do_sample")
    """False means greedy whatever the temperature."""

    def __post_init__(self) -> None:
        self.to_val_kwargs()

    def to_val_kwargs(self) -> ValKwargs:
        """The rollout manager's :class:`ValKwargs`."""
        return ValKwargs(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, do_sample=self.do_sample)


@dataclasses.dataclass(kw_only=True)
class MultiTurnConfig:
    """Request-level multi-turn rollouts with tools (``actor_rollout_ref.rollout.multi_turn.*``)."""

    enable: bool = False
    """Roll out through the agent loop (tools, interactions); needs ``data.return_raw_chat``."""
    max_turns: int = _default(AgentLoopConfig, "max_turns")
    """Assistant generations per request."""
    max_user_turns: int | None = _default(AgentLoopConfig, "max_user_turns")
    """Tool-response turns plus interaction replies per request; None: no limit."""
    tool_config_path: str | None = None
    """YAML listing the tools (e.g. ``configs/tools/gsm8k_tool_config.yaml``); None: no tools."""
    interaction_config_path: str | None = None
    """YAML listing the interactions (simulated users); None: none."""
    format: str = _default(AgentLoopConfig, "format")
    """Tool-call format of the model (``megarl.rollout.tool_parser.PARSERS``)."""
    tool_timeout_s: float | None = _default(AgentLoopConfig, "tool_timeout_s")
    """Per-call limit of a tool; None: no limit."""
    tokenization_sanity_check: str = _default(AgentLoopConfig, "tokenization_sanity_check")
    """``strict``, ``warn`` or ``off``: compare incremental tokenization with a full re-tokenization."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout.multi_turn"
        _check_positive(f"{p}.max_turns", self.max_turns)
        _check_choice(f"{p}.format", self.format, tuple(PARSERS))
        _check_choice(f"{p}.tokenization_sanity_check", self.tokenization_sanity_check, SANITY_CHECK_MODES)
        _check_positive(f"{p}.tool_timeout_s", self.tool_timeout_s, allow_none=True)
        if self.max_user_turns is not None and self.max_user_turns < 0:
            raise ValueError(f"{p}.max_user_turns must be >= 0 or null, got {self.max_user_turns}")


@dataclasses.dataclass(kw_only=True)
class RolloutSection:
    """Generation engines and sampling (``actor_rollout_ref.rollout.*``)."""

    name: str = "hf"
    """Engine: ``hf`` (HF transformers, one process per engine; CPU or GPU) or ``sglang`` (GPU)."""
    tensor_model_parallel_size: int | None = None
    """GPUs per SGLang engine; None: the actor's ``parallel.tp`` (TP-matched engines). The ``hf`` engine is
    never sharded: leave it null there."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory the engine may take (weights + KV cache)."""
    dtype: str = "bfloat16"
    """Engine weights' dtype."""
    enforce_eager: bool = True
    """Disable CUDA graphs in the engine."""
    free_cache_engine: bool = True
    """Release the KV cache after generation so training gets the memory back (needs ``enforce_eager``)."""
    n: int = _default(RolloutConfig, "n")
    """Samples per prompt in training (GRPO's group size)."""
    temperature: float = _default(RolloutConfig, "temperature")
    """Sampling temperature; 0 means greedy."""
    top_p: float = _default(RolloutConfig, "top_p")
    """Nucleus sampling mass."""
    top_k: int = _default(RolloutConfig, "top_k")
    """-1 disables top-k."""
    do_sample: bool = _default(RolloutConfig, "do_sample")
    """False means greedy (one sample per prompt)."""
    prompt_length: int | None = None
    """Prompt width ``P``; None: ``data.max_prompt_length``."""
    response_length: int | None = None
    """Response width ``R``; None: ``data.max_response_length``."""
    max_model_len: int | None = None
    """Engine context cap; None: ``P + R``."""
    seed: int | None = _default(RolloutConfig, "seed")
    """Seeds the engines' sampling per call; None: each engine's own seed."""
    calculate_log_probs: bool = _default(RolloutConfig, "calculate_log_probs")
    """Return the engines' log-probs (mismatch diagnostics and ``actor.tis_cap``)."""
    log_prob_micro_batch_size_per_gpu: int | None = 16
    """Trajectories per forward of the actor's log-prob recompute on one rank."""
    log_prob_use_dynamic_bsz: bool = False
    """Pack the recompute's micro-batches by token count (``log_prob_max_token_len_per_gpu``)."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of one recompute micro-batch on one rank, with ``log_prob_use_dynamic_bsz``."""
    engine_layout: str = "per_replica"
    """TP-matched SGLang engines with pipeline parallelism: ``per_replica`` (one engine per actor DP replica,
    on its first TP group) or ``per_tp_group`` (one on every TP group: every GPU generates, each holds the
    whole model at the engine TP)."""
    pool_nodes: list[int] | None = None
    """Disaggregated rollout (with ``hybrid_engine=false``): the engines' own pool, GPUs per node (on cpu:
    worker slots on this machine), e.g. ``[8, 8]``; None: engines share the actor's GPUs."""
    bucket_mb: int = 512
    """Weight sync: MiB of HF tensors per bucket streamed from the actor into the engines."""
    verify_weights: int = 8
    """Weight sync: tensors whose SHA-1 is compared between trainer and engines after every sync
    (a seeded sample, plus the last tensor); -1: all of them, 0: off."""
    val_kwargs: ValKwargsSection = dataclasses.field(default_factory=ValKwargsSection)
    """Validation sampling."""
    multi_turn: MultiTurnConfig = dataclasses.field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools."""

    def __post_init__(self) -> None:
        p = "actor_rollout_ref.rollout"
        _check_choice(f"{p}.name", self.name, ROLLOUT_NAMES)
        _check_choice(f"{p}.dtype", self.dtype, DTYPES)
        for key in ("tensor_model_parallel_size", "prompt_length", "response_length", "max_model_len"):
            _check_positive(f"{p}.{key}", getattr(self, key), allow_none=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{p}.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check_positive(f"{p}.bucket_mb", self.bucket_mb)
        _check_choice(f"{p}.engine_layout", self.engine_layout, ("per_replica", "per_tp_group"))
        if self.pool_nodes is not None and (not self.pool_nodes or any(n < 1 for n in self.pool_nodes)):
            raise ValueError(f"{p}.pool_nodes={self.pool_nodes} must list a positive number per node, e.g. [8]")
        if self.verify_weights < -1:
            raise ValueError(f"{p}.verify_weights must be -1 (all), 0 (off) or a count, got {self.verify_weights}")
        _check_micro_batches(f"{p}.log_prob", self.log_prob_micro_batch_size_per_gpu, self.log_prob_use_dynamic_bsz,
                             self.log_prob_max_token_len_per_gpu)
        self.to_rollout_config(prompt_length=self.prompt_length or 1, response_length=self.response_length or 1)

    def to_rollout_config(self, *, prompt_length: int, response_length: int) -> RolloutConfig:
        """The rollout manager's :class:`RolloutConfig`; the lengths come from :meth:`RunConfig.rollout_config`."""
        return RolloutConfig(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                             do_sample=self.do_sample, prompt_length=prompt_length, response_length=response_length,
                             val_kwargs=self.val_kwargs.to_val_kwargs(), seed=self.seed,
                             calculate_log_probs=self.calculate_log_probs, multi_turn=self.multi_turn.enable)


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
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    """Generation engines and sampling."""


# --------------------------------------------------------------------------------------- critic


@dataclasses.dataclass(kw_only=True)
class CriticConfig:
    """The value model (``critic.*``); required by ``algorithm.adv_estimator=gae``."""

    enable: bool = False
    """Train a critic (PPO with GAE)."""
    model_path: str | None = None
    """HF directory the value model starts from (its LM head replaced by a value head); None: the policy's."""
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
    cliprange_value: float | None = _default(value_loss, "cliprange_value")
    """Value clipping around the old values; None: off."""
    loss_agg_mode: str = _default(value_loss, "loss_agg_mode")
    """How token losses become one number."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule (critics learn faster than policies)."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Megatron layout of the critic."""
    param_offload: bool = False
    """Move parameters to host memory outside the update (GPU only)."""
    grad_offload: bool = False
    """Move gradient buffers to host memory outside the update (GPU only)."""
    optimizer_offload: bool = False
    """Move optimizer states to host memory outside the update (GPU only)."""

    def __post_init__(self) -> None:
        _check_positive("critic.ppo_mini_batch_size", self.ppo_mini_batch_size)
        _check_micro_batches("critic.ppo", self.ppo_micro_batch_size_per_gpu, self.use_dynamic_bsz,
                             self.ppo_max_token_len_per_gpu)
        _check_positive("critic.forward_micro_batch_size_per_gpu", self.forward_micro_batch_size_per_gpu,
                        allow_none=self.use_dynamic_bsz)
        _check_positive("critic.ppo_epochs", self.ppo_epochs)
        _check_positive("critic.cliprange_value", self.cliprange_value, allow_none=True)
        _check_choice("critic.loss_agg_mode", self.loss_agg_mode, AGG_MODES)


# ------------------------------------------------------------------------------ reward, algorithm


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
class RewardConfig:
    """Rule-based rewards (``reward_model.*``): the ``data_source`` registry or a custom function."""

    custom_reward_function: CustomRewardFunction = dataclasses.field(default_factory=CustomRewardFunction)
    """A custom scoring function replacing the registry."""
    scorer_kwargs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per ``data_source`` settings of registered scorers, e.g. ``{"openai/gsm8k": {"method": "flexible"}}``."""
    num_examine: int = 0
    """Decoded samples per ``data_source`` logged per training step."""

    def __post_init__(self) -> None:
        if self.num_examine < 0:
            raise ValueError(f"reward_model.num_examine must be >= 0, got {self.num_examine}")


@dataclasses.dataclass(kw_only=True)
class KLControlConfig:
    """The in-reward KL coefficient's controller (``algorithm.kl_ctrl.*``)."""

    type: str = _default(build_kl_controller, "type")
    """``fixed`` or ``adaptive``."""
    kl_coef: float = _default(build_kl_controller, "kl_coef")
    """Initial (fixed: constant) coefficient beta."""
    target_kl: float = _default(build_kl_controller, "target_kl")
    """KL the adaptive controller aims for."""
    horizon: float = _default(build_kl_controller, "horizon")
    """Adaptive controller's horizon in trajectories."""

    def __post_init__(self) -> None:
        _check_choice("algorithm.kl_ctrl.type", self.type, KL_CTRL_TYPES)
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {self.kl_coef}")
        _check_positive("algorithm.kl_ctrl.target_kl", self.target_kl)
        _check_positive("algorithm.kl_ctrl.horizon", self.horizon)


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantages and the in-reward KL (``algorithm.*``)."""

    adv_estimator: str = "grpo"
    """Advantage estimator (``megarl.algo.advantages.ESTIMATORS``); ``gae`` needs the critic."""
    gamma: float = _default(gae_advantage, "gamma")
    """Discount factor."""
    lam: float = _default(gae_advantage, "lam")
    """GAE's lambda."""
    whiten: bool = _default(gae_advantage, "whiten")
    """Whiten GAE advantages over the batch."""
    norm_adv_by_std_in_grpo: bool = _default(grpo_outcome_advantage, "norm_adv_by_std_in_grpo")
    """Divide GRPO advantages by the group's std (False: Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract ``beta * KL(pi_old || pi_ref)`` from the token rewards; needs the reference model."""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty (``megarl.algo.kl.KL_KINDS``)."""
    kl_ctrl: KLControlConfig = dataclasses.field(default_factory=KLControlConfig)
    """The in-reward KL coefficient's controller."""

    def __post_init__(self) -> None:
        _check_choice("algorithm.adv_estimator", self.adv_estimator, tuple(sorted(ESTIMATORS)))
        _check_choice("algorithm.kl_penalty", self.kl_penalty, KL_KINDS)
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"algorithm.gamma must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"algorithm.lam must be in [0, 1], got {self.lam}")


# -------------------------------------------------------------------------------------- trainer


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """The run: length, machines, checkpoints, validation, logging (``trainer.*``)."""

    total_epochs: int = 1
    """Passes over the training prompts."""
    total_steps: int | None = None
    """Training steps; None: ``total_epochs`` × batches per epoch. When set it wins over ``total_epochs``."""
    device: str = "cuda"
    """``cuda`` (GPU workers, NCCL) or ``cpu`` (gloo workers; for tests and the tiny recipe)."""
    nnodes: int = 1
    """Machines, with ``device=cuda``."""
    n_gpus_per_node: int = 8
    """GPUs per machine, with ``device=cuda``."""
    n_cpu_ranks: int = 2
    """Worker processes (gloo ranks) on this machine, with ``device=cpu``: the CPU world size."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB (2^30 bytes), with ``device=cuda``: what ``megarl-plan`` and the trainer's
    pre-flight check (``megarl.controller.plan``) plan against. An "80 GB" A100/H100 has 80 GiB of HBM, of
    which CUDA reports about 79.2 as usable; set less to keep headroom."""
    seed: int = 1
    """Seed of data order, sampling and initialization."""
    critic_warmup: int = 0
    """Steps that train only the critic before the actor starts updating."""
    balance_batch: bool = True
    """Reorder trajectories so each data-parallel rank gets a similar token count."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Validate once and stop."""
    test_freq: int = -1
    """Validate every this many steps (and at the last one); -1: never during training."""
    save_freq: int = -1
    """Checkpoint every this many steps (and at the last one); -1: never."""
    default_local_dir: str = "checkpoints"
    """Checkpoint root: ``<default_local_dir>/<project_name>/<experiment_name>/global_step_<k>``."""
    max_actor_ckpt_to_keep: int | None = None
    """Checkpoints kept; older ones are deleted. None: keep all."""
    resume_mode: str = "auto"
    """``auto`` (latest checkpoint if any), ``disable`` or ``resume_path``."""
    resume_from_path: str | None = None
    """Checkpoint directory to resume from, with ``resume_mode=resume_path``."""
    export_hf: bool = False
    """Also write HF-format weights with each checkpoint."""
    logger: list[str] = dataclasses.field(default_factory=lambda: ["console", "tensorboard"])
    """Metric sinks: ``console``, ``tensorboard``, ``jsonl``."""
    log_dir: str = "runs"
    """Root of TensorBoard and jsonl logs: ``<log_dir>/<project_name>/<experiment_name>``."""
    project_name: str = "megarl"
    """Project name (log and checkpoint folders)."""
    experiment_name: str = "default"
    """Experiment name (log and checkpoint folders)."""
    rollout_data_dir: str | None = None
    """Write each step's trajectories as jsonl here; None: off."""
    log_val_generations: int = 0
    """Validation samples logged per validation."""

    def __post_init__(self) -> None:
        _check_positive("trainer.total_epochs", self.total_epochs)
        _check_positive("trainer.total_steps", self.total_steps, allow_none=True)
        _check_choice("trainer.device", self.device, DEVICES)
        _check_positive("trainer.nnodes", self.nnodes)
        _check_positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        _check_positive("trainer.n_cpu_ranks", self.n_cpu_ranks)
        _check_positive("trainer.gpu_memory_gb", self.gpu_memory_gb)
        _check_choice("trainer.resume_mode", self.resume_mode, RESUME_MODES)
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        for key in ("test_freq", "save_freq"):
            value = getattr(self, key)
            if value == 0 or value < -1:
                raise ValueError(f"trainer.{key} must be -1 (off) or >= 1, got {value}")
        if self.critic_warmup < 0:
            raise ValueError(f"trainer.critic_warmup must be >= 0, got {self.critic_warmup}")
        _check_positive("trainer.max_actor_ckpt_to_keep", self.max_actor_ckpt_to_keep, allow_none=True)
        for name in self.logger:
            _check_choice("trainer.logger", name, LOGGERS)

    @property
    def world_size(self) -> int:
        """Ranks shared by the colocated roles: ``nnodes × n_gpus_per_node`` on cuda, ``n_cpu_ranks`` on cpu."""
        return self.n_cpu_ranks if self.device == "cpu" else self.nnodes * self.n_gpus_per_node


# ------------------------------------------------------------------------------------------ run


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """One training run. Build it with :func:`megarl.config.load_config`; check it with :func:`megarl.config.validate`."""

    recipe: str = "custom"
    """Name of the recipe (``configs/recipe/<name>.yaml``) this config came from."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompt data."""
    actor_rollout_ref: ActorRolloutRefConfig = dataclasses.field(default_factory=ActorRolloutRefConfig)
    """The policy, its reference and its rollout engines."""
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    """The value model."""
    reward_model: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """Rewards."""
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """Advantages and the in-reward KL."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """Length, machines, checkpoints, logging."""

    @property
    def needs_ref(self) -> bool:
        """A reference model is needed when a KL term is on (the KL loss or the in-reward KL)."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def rollout_config(self) -> RolloutConfig:
        """The rollout manager's :class:`RolloutConfig`, with ``P``/``R`` defaulting to ``data.*``."""
        rollout = self.actor_rollout_ref.rollout
        return rollout.to_rollout_config(prompt_length=rollout.prompt_length or self.data.max_prompt_length,
                                         response_length=rollout.response_length or self.data.max_response_length)

    def agent_loop_config(self) -> AgentLoopConfig:
        """The multi-turn :class:`AgentLoopConfig` (sampling, lengths and ``multi_turn.*``)."""
        rollout = self.actor_rollout_ref.rollout
        multi_turn = rollout.multi_turn
        base = self.rollout_config()
        return AgentLoopConfig(prompt_length=base.prompt_length, response_length=base.response_length,
                               max_model_len=rollout.max_model_len, max_turns=multi_turn.max_turns,
                               max_user_turns=multi_turn.max_user_turns, tool_timeout_s=multi_turn.tool_timeout_s,
                               format=multi_turn.format, tokenization_sanity_check=multi_turn.tokenization_sanity_check,
                               temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                               seed=rollout.seed, return_logprob=rollout.calculate_log_probs)


def register_schema() -> None:
    """Register :class:`RunConfig` in Hydra's ConfigStore as :data:`SCHEMA_NAME` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)
