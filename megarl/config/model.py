"""The models of a run (the policy, ``actor_rollout_ref.model.*``; scoring models, ``teacher.model.*`` and
``reward_model.model.*``) and the
optimizer of a trainable role (``<role>.optim.*``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import MISSING

from megarl.config.common import DTYPES, check_choice, check_positive

MODEL_INITS = ("pretrained", "tiny_sft")
REWARD_MODEL_INITS = ("pretrained", "tiny_rm")
TINY_ARCHS = ("qwen2", "llama", "qwen3_moe", "deepseek_v3", "qwen3_5_moe", "qwen2_5_vl")
"""``model.tiny_arch`` values (megarl.models.tiny.TINY_ARCHS; config sits below models, so the names are listed here
and a test checks they agree)."""
DECAY_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass(kw_only=True)
class ModelSource:
    """Where a model of the run comes from and how it computes: the policy's (:class:`ModelConfig`) and a scoring
    model's (:class:`ScoringModelConfig`). ``KEY``: the section's key, which its errors name."""

    KEY: ClassVar[str] = "actor_rollout_ref.model"
    INITS: ClassVar[tuple[str, ...]] = MODEL_INITS
    path: str = MISSING
    """HF model directory (or hub id already in the local cache); with ``init=tiny_sft``, where the tiny model is cached."""
    tokenizer_path: str | None = None
    """Tokenizer directory; None: ``path``."""
    init: str = "pretrained"
    """``pretrained``: load ``path``. ``tiny_sft``: build ``megarl.models.tiny``'s Qwen2 model and tokenizer,
    warm-start it by SFT on ``data.train_files`` and cache it at ``path`` (reused when present)."""
    tiny_arch: str = "qwen2"
    """``init=tiny_sft``: the tiny model's architecture, ``qwen2`` (dense), ``qwen3_moe`` or ``deepseek_v3``
    (mixtures of experts; the latter with multi-latent attention) or ``qwen2_5_vl`` (vision-language, on image data;
    :data:`megarl.models.tiny.TINY_ARCHS`)."""
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
    """Allow model and tokenizer code from the model directory (passed to every transformers loader)."""
    use_remove_padding: bool = True
    """Pack each micro-batch's sequences end to end (THD, no compute on padding) in the model's forward and backward
    passes; false: pad them to a rectangle (megarl.parallel.packing)."""

    def __post_init__(self) -> None:
        p = self.KEY
        check_choice(f"{p}.init", self.init, self.INITS)
        check_choice(f"{p}.tiny_arch", self.tiny_arch, TINY_ARCHS)
        check_choice(f"{p}.dtype", self.dtype, DTYPES)
        check_positive(f"{p}.sft_steps", self.sft_steps)
        check_positive(f"{p}.sft_lr", self.sft_lr)
        if self.sft_stop_reward is not None and not 0.0 < self.sft_stop_reward <= 1.0:
            raise ValueError(f"{p}.sft_stop_reward={self.sft_stop_reward!r} must be in (0, 1]; "
                             f"set it to null to run all sft_steps")

    @property
    def local_path(self) -> str:
        """``path`` with ``~`` expanded."""
        return str(Path(self.path).expanduser())

    @property
    def local_tokenizer_path(self) -> str:
        """``tokenizer_path`` (else ``path``) with ``~`` expanded."""
        return str(Path(self.tokenizer_path or self.path).expanduser())


@dataclasses.dataclass(kw_only=True)
class ModelConfig(ModelSource):
    """The policy model (``actor_rollout_ref.model.*``)."""

    lora_rank: int = 0
    """LoRA adapters of this rank on the actor's linear layers (``target_modules``), the base frozen; 0: off
    (verl's name). The reference policy is then the actor with its adapters off (no second model)."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: an adapter adds ``lora_alpha / lora_rank · B A x``."""
    target_modules: Any = "all-linear"
    """The layers adapted: ``all-linear``, or a list of Megatron's (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
    ``linear_fc2``) or PEFT's names (``q_proj`` ... ``down_proj``; a fused layer's parts together)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        p = self.KEY
        if self.lora_rank < 0:
            raise ValueError(f"{p}.lora_rank={self.lora_rank} must be >= 0 (0: no LoRA)")
        if self.lora_rank:
            check_positive(f"{p}.lora_alpha", self.lora_alpha)
            self.lora_spec  # the targets, checked

    @property
    def lora_spec(self):
        """The adapters' :class:`~megarl.config.lora.LoraSpec`; None without LoRA (``lora_rank=0``)."""
        if not self.lora_rank:
            return None
        from megarl.config.lora import LoraSpec, lora_targets

        targets = self.target_modules
        if not isinstance(targets, str):
            targets = list(targets)
        return LoraSpec(rank=int(self.lora_rank), alpha=float(self.lora_alpha),
                        targets=lora_targets(targets, setting="actor_rollout_ref.model.target_modules"))


@dataclasses.dataclass(kw_only=True)
class ScoringModelConfig(ModelSource):
    """A model that scores the policy's samples, never trained (``teacher.model.*``): its ``path`` is needed once
    its section is on."""

    KEY: ClassVar[str] = "teacher.model"
    path: str | None = None
    """HF model directory; with ``init=tiny_sft``, where the tiny model is cached."""


@dataclasses.dataclass(kw_only=True)
class RewardModelSource(ScoringModelConfig):
    """A reward model's checkpoint (``reward_model.model.*``): an HF sequence-classification model with one label
    (``*ForSequenceClassification`` of a family megarl serves); ``init=tiny_rm`` trains the tiny recipe's own
    (:mod:`megarl.warmstart.reward_model`) and caches it at ``path``."""

    KEY: ClassVar[str] = "reward_model.model"
    INITS: ClassVar[tuple[str, ...]] = REWARD_MODEL_INITS
    body_path: str | None = None
    """``init=tiny_rm``: where the model its classifier starts from is cached, a tiny SFT warm start built with
    ``sft_steps`` and ``sft_lr`` (a recipe's teacher cache is reused when the settings agree); None: the policy
    (``actor_rollout_ref.model.path``)."""
    rm_steps: int = 1500
    """``init=tiny_rm``: training steps of the classifier (batches of 64 labelled responses)."""
    rm_lr: float = 3e-4
    """``init=tiny_rm``: its learning rate (AdamW, warm-up and decay as the SFT warm start's)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(f"{self.KEY}.rm_steps", self.rm_steps)
        check_positive(f"{self.KEY}.rm_lr", self.rm_lr)


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule of a trainable role (``<role>.optim.*``)."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay (none on biases and norms)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's beta1 and beta2."""
    eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    decay_steps: int | None = None
    """Steps of decay after warm-up (None: constant after warm-up)."""
    decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine``."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states over data-parallel ranks (Megatron's distributed optimizer)."""
    override_optimizer_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Fields of Megatron's ``OptimizerConfig`` set as given (verl's passthrough, megatron-core's names), e.g. its
    hybrid CPU optimizer: ``optimizer_cpu_offload: true`` with ``optimizer_offload_fraction`` (the share of the
    optimizer states kept and stepped on the host; Megatron's default 0), ``overlap_cpu_optimizer_d2h_h2d``,
    ``pin_cpu_grads``; ``use_precision_aware_optimizer`` (TransformerEngine). The fields above are set from this
    section and refused here (:mod:`megarl.config.megatron`)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        check_choice("optim.decay_style", self.decay_style, DECAY_STYLES)
        if self.decay_style != "constant" and not self.decay_steps:
            raise ValueError(f"optim.decay_style={self.decay_style!r} needs optim.decay_steps > 0")
