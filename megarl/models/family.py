"""One declarative entry per model family: HF config -> Megatron TransformerConfig and layer spec.

A :class:`ModelFamily` says which HF architectures it serves and which features those
architectures have (biases, q/k norms, ...). From it and an HF config, megarl derives the
``TransformerConfig``, the ``GPTModel`` arguments and the layer spec; the converter
(``megarl.convert``) reads the same entry for the tensor mapping. The registry is a plain
dict keyed by the HF ``architectures`` name.

Legend for shapes in this package: B batch, S sequence, V vocabulary, H hidden.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from megarl.config.parallel import ParallelDims
from megarl.models.attention import AttentionSpec
from megarl.models.linear_attention import FULL, LinearAttentionSpec, linear_mixer
from megarl.models.mla import MLASpec, rope_parameters
from megarl.models.moe import MoESpec
from megarl.models.vision import VisionSpec
from megarl.models.weights import RuleAt, WeightRule, coload_key

# Llama 3.x RoPE scaling constants that Megatron's RotaryEmbedding hard-codes.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """What megarl needs to know about one family of HF decoder-only models."""

    name: str
    """Short name used in recipes and messages (``llama``, ``qwen2``, ``qwen3``)."""
    architectures: tuple[str, ...]
    """HF ``architectures`` values served by this entry (its causal LMs; each ``*ForCausalLM`` also serves as the body
    of its ``*ForSequenceClassification``: :attr:`classifier_architectures`)."""
    bias_settings: tuple[str, ...]
    """HF config flags that would add biases Megatron's GPT layers cannot hold; must be false."""
    weights: tuple[WeightRule, ...]
    """How every HF tensor maps to a Megatron tensor (see megarl.models.weights)."""
    moe: MoESpec | None = None
    """The experts of a mixture-of-experts family (None: every MLP is dense)."""
    vision: VisionSpec | None = None
    """The vision tower of a vision-language family (None: a text model; :mod:`megarl.models.vision`)."""
    mla: MLASpec | None = None
    """Multi-latent attention (DeepSeek-V3, Kimi-K2; :mod:`megarl.models.mla`); None: grouped-query attention."""
    attention: AttentionSpec = AttentionSpec()
    """Grouped-query attention's variants (:mod:`megarl.models.attention`: q/k norms over all heads, an output
    gate)."""
    linear_attention: LinearAttentionSpec | None = None
    """Gated DeltaNet layers among the full-attention ones (:mod:`megarl.models.linear_attention`: Qwen3.5,
    Qwen3-Next); None: every layer full attention."""
    zero_centered_norms: bool = False
    """The RMSNorms hold ``gamma - 1`` and scale by ``1 + weight`` (Qwen3.5, Qwen3-Next: Megatron's
    ``layernorm_zero_centered_gamma``); the checkpoint's values map unchanged."""
    config_aliases: tuple[tuple[str, str], ...] = ()
    """``(model_type, transformers model_type)``: checkpoints of this family whose ``model_type`` transformers has no
    config class for (Kimi-K2's ``kimi_k2``, whose hub repository ships DeepSeek-V3's config code), read with the
    config class of the second (:func:`read_hf_config`)."""
    engine_reads_back: bool = False
    """SGLang's model class for these architectures answers ``/get_weights_by_name`` (Llama's and Mistral's, with
    SGLang's TP semantics: :mod:`megarl.engines.cpu_engine.read_back`); for every other family SGLang answers an
    error, the weight sync cannot read its engines' weights back and reports them unverified, and megarl's CPU engine
    refuses as SGLang does."""
    engine_settings: tuple[tuple[str, Any, str], ...] = ()
    """``(key, value, what SGLang does otherwise)``: HF config keys that SGLang's model class for these architectures
    reads and transformers does not (MiniMax-M2's ``use_qk_norm``: transformers always applies the norms, SGLang only
    under it). A config must hold each at its value (a callable: computed from the config), or the engines would
    serve another model than the one trained; :meth:`transformer_config` refuses it, naming the key."""
    extra_prefix: str | None = None
    """Where the checkpoint keeps its multi-token-prediction module outside the model's layers (Qwen3.5's and
    Qwen3-Next's ``mtp.``): skipped on load like :attr:`extra_layers_key`'s layers, kept by ``megarl-convert``."""
    extra_layers_key: str | None = None
    """HF config key of how many layers the checkpoint holds after the model's (DeepSeek-V3's multi-token-prediction
    layer, ``num_nextn_predict_layers``): skipped on load (:meth:`skipped_tensors`), never trained or exported."""

    def skipped_tensors(self, hf_config, names) -> list[str]:
        """Of a checkpoint's tensor ``names``, those of layers past the model's that the family skips (its
        multi-token-prediction layers, ``model.layers.<num_hidden_layers + k>.*``, or under :attr:`extra_prefix`)."""
        prefixes = (self.extra_prefix,) if self.extra_prefix else ()
        if self.extra_layers_key is not None:
            first = int(hf_config.num_hidden_layers)
            extra = int(getattr(hf_config, self.extra_layers_key, 0) or 0)
            prefixes += tuple(f"model.layers.{first + k}." for k in range(extra))
        return [name for name in names if prefixes and name.startswith(prefixes)]

    def qkv_bias(self, hf_config) -> bool:
        """Whether the q/k/v projections of ``hf_config``'s model carry a bias (a rule that applies to it maps one:
        Qwen2's always, GLM-4.5's under its ``attention_bias``)."""
        return any(rule.megatron.endswith("linear_qkv.bias") for rule in self.weight_rules(hf_config))

    def qk_norm(self, hf_config) -> bool:
        """RMSNorm on queries and keys per head (Qwen3; GLM-4.5 under ``use_qk_norm``; MLA's low-rank norms)."""
        return any(rule.megatron.endswith("q_layernorm.weight") for rule in self.weight_rules(hf_config))

    def weight_rules(self, hf_config) -> tuple[WeightRule, ...]:
        """The rules that apply to ``hf_config`` (the output layer only when untied)."""
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        text = tuple(rule for rule in self.weights if not (tied and rule.untied_only)
                     and (rule.when is None or getattr(hf_config, rule.when, False)))
        return text if self.vision is None else self.vision.weight_rules(hf_config) + text

    def sparse_layers(self, hf_config) -> tuple[bool, ...]:
        """Per layer: whether its MLP is a mixture of experts."""
        if self.moe is None:
            return (False,) * int(hf_config.num_hidden_layers)
        return self.moe.sparse_layers(hf_config)

    def layer_attention(self, hf_config) -> tuple[str, ...]:
        """Per layer: its attention, ``full_attention`` or ``linear_attention`` (:mod:`megarl.models.linear_attention`)."""
        if self.linear_attention is None:
            return (FULL,) * int(hf_config.num_hidden_layers)
        from megarl.models.linear_attention import LINEAR

        return tuple(LINEAR if linear else FULL for linear in self.linear_attention.linear_layers(hf_config))

    def named_sizes(self, hf_config) -> dict[str, int]:
        """The row counts the weight rules' :class:`~megarl.models.weights.Rows` name (empty without any)."""
        return self.linear_attention.named_sizes(hf_config) if self.linear_attention is not None else {}

    def weight_instances(self, hf_config) -> list[RuleAt]:
        """Every Megatron tensor of the model, in HF order (embedding and a vision tower, layers in order, final norm,
        output layer):
        each rule at each layer that has it and, for expert tensors, at each expert."""
        rules = self.weight_rules(hf_config)
        experts = self.moe.num_experts(hf_config) if self.moe is not None else 0
        out = [RuleAt(r) for r in rules if not r.per_layer and r.on_first_stage]
        kinds = self.layer_attention(hf_config)
        for layer, sparse in enumerate(self.sparse_layers(hf_config)):
            layer_rules = [r for r in rules if r.per_layer and r.applies_to(sparse, kinds[layer])]
            expert_rules = [r for r in layer_rules if r.per_expert]
            for rule in layer_rules:
                if not rule.per_expert:
                    out.append(RuleAt(rule, layer))
                elif rule is expert_rules[0]:
                    # Each expert's tensors together (the hub's order): an expert-parallel rank's experts are then
                    # consecutive, so the weight sync packs them into as few buckets as their bytes need.
                    out += [RuleAt(r, layer, e) for e in range(experts) for r in expert_rules]
        out += [RuleAt(r) for r in rules if not r.per_layer and not r.on_first_stage]
        return out

    def coload_groups(self, hf_config) -> list[tuple[str, ...]]:
        """HF names that SGLang's loader takes only together, in one weight-update request (each group in rule order;
        :attr:`~megarl.models.weights.WeightRule.coload`)."""
        groups: dict[tuple, list[str]] = {}
        for at in self.weight_instances(hf_config):
            if (key := coload_key(at)) is not None:
                groups.setdefault(key, []).extend(at.hf_names)
        return [tuple(names) for names in groups.values()]

    # ----------------------------------------------------------------------------- config
    def uses_te(self, use_te: bool | None = None) -> bool:
        """Whether this family's layers are built on TransformerEngine's spec: ``use_te`` (None: when TE is importable
        and a GPU is present; multi-latent attention too, on TE's MLA spec: :mod:`megarl.models.mla`). The one
        choice :meth:`block_spec` builds by and :meth:`transformer_config` sets TE-only fusions by."""
        if use_te is None:
            use_te = torch.cuda.is_available() and _te_importable()
        return bool(use_te)

    def transformer_config(self, hf_config, dims: ParallelDims, *, use_te: bool | None = None, **overrides):
        """Megatron ``TransformerConfig`` for ``hf_config`` split by ``dims``, for layers built on TE's spec or not
        (``use_te``, as :meth:`block_spec` takes it: LoRA builds the local spec on a machine with TE).

        ``overrides`` are TransformerConfig fields (e.g. ``params_dtype=torch.bfloat16``,
        ``recompute_granularity="full"``); they win over the derived values.
        """
        from megatron.core.transformer import MLATransformerConfig, TransformerConfig

        self._check_supported(hf_config)
        sizes = self._sizes(hf_config)
        dims.check_model(
            num_layers=sizes["num_layers"],
            num_attention_heads=sizes["num_attention_heads"],
            num_query_groups=sizes["num_query_groups"],
            num_experts=self.moe.num_experts(hf_config) if self.moe is not None else None,
            expert_ffn=self.moe.ffn_size(hf_config) if self.moe is not None else None,
        )
        on_gpu = torch.cuda.is_available()
        use_te = self.uses_te(use_te)  # the layer spec's choice (block_spec)
        params_dtype = overrides.pop("params_dtype", torch.float32)
        kwargs = dict(
            **sizes,
            layernorm_epsilon=float(hf_config.rms_norm_eps),
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias(hf_config),
            # Megatron's qk_layernorm is the per-head norm, whose replicated weight's gradient it sums over TP by
            # name; norms over all heads (split by head) are the attention spec's own (megarl.models.attention)
            qk_layernorm=self.qk_norm(hf_config) and not self.attention.qk_norm_all_heads,
            attention_output_gate=self.attention.output_gate,
            layernorm_zero_centered_gamma=self.zero_centered_norms,
            init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
            hidden_dropout=0.0,
            attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
            attention_softmax_in_fp32=True,
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp and dims.vpp > 1 else None,
            num_layers_in_first_pipeline_stage=dims.first_stage_layers,
            num_layers_in_last_pipeline_stage=dims.last_stage_layers,
            context_parallel_size=dims.cp,
            cp_comm_type=dims.cp_comm_type if dims.cp > 1 else None,
            sequence_parallel=dims.sequence_parallel,
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            # megarl's losses are already normalised by the global token/sequence count of the
            # mini-batch (megarl.algo): Megatron must neither divide by the number of
            # micro-batches nor average over data-parallel ranks.
            calculate_per_token_loss=True,
            **self._device_kwargs(on_gpu=on_gpu, use_te=use_te),
            # Megatron's default ("full") is deprecated in favour of an empty list.
            cuda_graph_scope=[],
        )
        if overrides.get("perform_initialization") is False and not on_gpu:
            # Megatron's CPU init path sets the tensor-parallel attributes of linear weights
            # (tensor_model_parallel, partition_dim) only while initialising them: without them
            # gradient-norm clipping treats sharded weights as duplicates and gets the norm wrong.
            raise ValueError("perform_initialization=False is not supported on CPU (it leaves TP attributes unset)")
        if self.moe is not None:
            kwargs.update(self._moe_kwargs(hf_config, dims, use_te=use_te))
        if self.mla is not None:
            self.mla.check(hf_config)
            kwargs.update(self.mla.config_kwargs(hf_config))
        if self.linear_attention is not None:
            self.linear_attention.check(hf_config, dims)
            kwargs.update(self.linear_attention.config_kwargs(hf_config))
        if self.vision is not None:
            kwargs.update(self._vision_kwargs(hf_config, dims, sizes["num_layers"], overrides))
        kwargs.update(overrides)
        return (TransformerConfig if self.mla is None else MLATransformerConfig)(**kwargs)

    def _device_kwargs(self, *, on_gpu: bool, use_te: bool) -> dict[str, Any]:
        """The settings that follow the machine (CUDA or not) and the layer spec (TransformerEngine's or not)."""
        return dict(
            # Fused kernels exist only on GPU.
            use_cpu_initialization=not on_gpu,
            # Megatron's fused masked softmax (local attention) imports a kernel that no package ships
            # (scaled_masked_softmax_cuda); TransformerEngine's attention brings its own.
            masked_softmax_fusion=use_te,
            bias_activation_fusion=on_gpu,
            bias_dropout_fusion=on_gpu,
            # TE's fused RoPE (THD too); multimodal RoPE and MLA's (training-only, YaRN-only in Megatron) unfused.
            apply_rope_fusion=use_te and self.vision is None and self.mla is None,
            # TE's layers accumulate weight gradients into main_grad; the output layer (Megatron's own linear) then
            # needs apex's fused_weight_gradient_mlp_cuda, so only where that extension is importable.
            gradient_accumulation_fusion=use_te and _importable("fused_weight_gradient_mlp_cuda"),
            persist_layer_norm=on_gpu,
            batch_p2p_sync=on_gpu,
            # With gloo, batched p2p posts sends and receives in one fixed order on every rank;
            # with two pipeline ranks under interleaving (prev == next) that pairs an activation
            # with a gradient of the same shape. The even/odd-ordered path pairs them correctly.
            batch_p2p_comm=on_gpu,
        )

    def _vision_kwargs(self, hf_config, dims: ParallelDims, num_layers: int, overrides: dict) -> dict[str, Any]:
        """A vision-language family's multimodal RoPE sections, refusing layouts it cannot run (CP; a first stage
        without the DeepStack layers; full recomputation of them)."""
        if dims.cp > 1:
            raise ValueError(f"parallel.cp={dims.cp}: the {self.name} family (multimodal RoPE) runs without "
                             "context parallelism; set cp=1 and split the model with tp/pp")
        deepstack = self.vision.deepstack_layers(hf_config)
        per_chunk = len(dims.chunk_layers(num_layers, 0))
        if deepstack > per_chunk:
            raise ValueError(f"parallel.pp={dims.pp}: the first pipeline stage holds {per_chunk} layer(s), and "
                             f"the {self.name} family adds its vision features to the first {deepstack} "
                             "(DeepStack): lower pp (or vpp) so that the first stage holds them")
        if deepstack and overrides.get("recompute_granularity") == "full":
            raise ValueError(f"recompute_granularity=full: the {self.name} family's DeepStack layers take this "
                             "micro-batch's vision features, which a recomputed layer would not see; use "
                             "recompute_granularity=selective or null")
        return {"mrope_section": self.vision.mrope_section(hf_config)}

    def _moe_kwargs(self, hf_config, dims: ParallelDims, *, use_te: bool) -> dict[str, Any]:
        """Megatron's MoE settings for ``hf_config`` (router as HF's: softmax scores, renormalised top-k or not)."""
        moe = self.moe
        moe.check(hf_config)
        sparse = moe.sparse_layers(hf_config)
        return dict(
            num_moe_experts=moe.num_experts(hf_config),
            moe_ffn_hidden_size=moe.ffn_size(hf_config),
            moe_router_topk=moe.topk(hf_config),
            moe_router_score_function=moe.score_function,
            moe_router_pre_softmax=moe.score_function == "softmax" and not moe.renormalises(hf_config),
            moe_router_enable_expert_bias=moe.expert_bias,
            # the checkpoint's bias kept, as slime's RL recipes keep it; a rate (override_transformer_config) updates
            # it each step (megarl.models.moe.prepare_expert_bias)
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=moe.scaling(hf_config) if moe.scaling(hf_config) != 1.0 else None,
            moe_router_num_groups=None if moe.groups(hf_config) is None else moe.groups(hf_config)[0],
            moe_router_group_topk=None if moe.groups(hf_config) is None else moe.groups(hf_config)[1],
            moe_layer_freq=1 if all(sparse) else [int(s) for s in sparse],
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # Grouped GEMM through TransformerEngine on GPU; one linear pair per expert (SequentialMLP) on CPU.
            moe_grouped_gemm=use_te,
            # All-to-all: ranks hold different token counts (packed sequences); the same path on CPU (gloo).
            moe_token_dispatcher_type="alltoall",
            # Megatron's fused top-k returns before its RouterReplay is consulted (moe_utils'
            # topk_routing_with_score_function), which megarl's routing replay drives: the router stays unfused.
            moe_router_fusion=False,
            # TE's fused token permutation (TE >= 2.1), where TE is there.
            moe_permute_fusion=use_te and _te_at_least("2.1.0"),
            expert_model_parallel_size=dims.ep,
            expert_tensor_parallel_size=dims.expert_tp,
            moe_shared_expert_intermediate_size=moe.shared_ffn_size(hf_config) or None,
            moe_shared_expert_gate=moe.shared_expert_gate and bool(moe.shared_ffn_size(hf_config)),
        )

    def _sizes(self, hf_config) -> dict[str, int]:
        heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return dict(
            num_layers=int(hf_config.num_hidden_layers),
            hidden_size=int(hf_config.hidden_size),
            # (a model whose every layer is sparse may name no dense size: Megatron's then goes unused)
            ffn_hidden_size=int(getattr(hf_config, "intermediate_size", None) or self.moe.ffn_size(hf_config)),
            num_attention_heads=heads,
            num_query_groups=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            kv_channels=int(head_dim),
        )

    @property
    def classifier_architectures(self) -> tuple[str, ...]:
        """The sequence-classification models of the family (a reward model: the causal LM's body and a one-label
        ``score`` head instead of the LM head, :func:`megarl.convert.loader.load_hf_into`)."""
        return tuple(a.replace("ForCausalLM", "ForSequenceClassification") for a in self.architectures
                     if a.endswith("ForCausalLM"))

    def _check_supported(self, hf_config) -> None:
        for key, value, otherwise in self.engine_settings:
            wanted = value(hf_config) if callable(value) else value
            if getattr(hf_config, key, None) != wanted:
                raise ValueError(f"{key}={getattr(hf_config, key, None)!r} in the HF config (want {wanted!r}): "
                                 f"SGLang's {self.name} model reads it and {otherwise}; set {key}: {wanted!r} in "
                                 "config.json (the published checkpoints' value)")
        arch = (getattr(hf_config, "architectures", None) or [None])[0]
        if arch is not None and arch not in self.architectures + self.classifier_architectures:
            raise ValueError(f"the {self.name} family does not serve architecture {arch!r}")
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} in the HF config is not supported: megarl maps SwiGLU (silu) MLPs")
        for flag in self.bias_settings:
            if getattr(hf_config, flag, False):
                raise ValueError(
                    f"{flag}=true in the HF config adds biases that Megatron's GPT layers cannot hold; "
                    "this checkpoint is not supported"
                )
        window = getattr(hf_config, "sliding_window", None)
        uses_window = getattr(hf_config, "use_sliding_window", True)
        if window and uses_window and window < getattr(hf_config, "max_position_embeddings", 0):
            warnings.warn(
                f"sliding_window={window} in the HF config is ignored: megarl attends over the full "
                f"sequence, which matches the HF model only for sequences of at most {window} tokens",
                stacklevel=3,
            )

    # ------------------------------------------------------------------------ GPTModel
    def padded_vocab_size(self, hf_config, tp: int) -> int:
        """Vocabulary padded as SGLang's VocabParallelEmbedding pads it for ``tp`` ranks.

        A multiple of 64, or of 64 × tp when that is not divisible by tp. Padding like the
        rollout engine makes Megatron's vocabulary shards line up with the engine's, so
        TP-matched weight sync needs no gather for the embedding and output layer.
        """
        return sglang_padded_vocab(int(hf_config.vocab_size), tp)

    def rope_kwargs(self, hf_config) -> dict[str, Any]:
        """GPTModel's RoPE arguments from the HF config (base and scaling)."""
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        if self.mla is not None:  # multi-latent attention applies its own (MLATransformerConfig's rope fields)
            return {"position_embedding_type": "none"}
        kwargs: dict[str, Any] = {
            "position_embedding_type": "rope" if self.vision is None else "mrope",
            "rotary_base": float(params.get("rope_theta", 10000.0)),
        }
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            kwargs["rotary_percent"] = float(params["partial_rotary_factor"])
        if rope_type in ("default", "mrope"):  # "mrope": Qwen2-VL configs written before rope_parameters
            return kwargs
        if rope_type == "linear":
            kwargs["seq_len_interpolation_factor"] = float(params["factor"])
            return kwargs
        if rope_type == "llama3":
            for key, value in _MEGATRON_LLAMA3_ROPE.items():
                if float(params.get(key, value)) != value:
                    raise ValueError(
                        f"rope_scaling.{key}={params[key]} in the HF config: Megatron's Llama 3 RoPE "
                        f"scaling is fixed at {key}={value}; this checkpoint is not supported"
                    )
            kwargs.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]))
            return kwargs
        raise ValueError(
            f"rope_scaling.rope_type={rope_type!r} in the HF config is not supported "
            "(supported: default, linear, llama3)"
        )

    def gpt_model_kwargs(self, hf_config, dims: ParallelDims) -> dict[str, Any]:
        """Arguments of ``GPTModel`` other than config, spec and stage flags."""
        return dict(
            vocab_size=self.padded_vocab_size(hf_config, dims.tp),
            max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
            share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
            parallel_output=True,
            **self.rope_kwargs(hf_config),
        )

    def block_spec(self, config, *, vp_stage: int | None = None, use_te: bool | None = None):
        """The transformer block's spec: TransformerEngine's layer spec when TE is importable and a GPU is present,
        else Megatron's local one with megarl's attention and norms, final norm included
        (:func:`megarl.models.local_spec.local_block_spec`: packing, context and sequence parallelism)."""
        from megatron.core.models.gpt import gpt_layer_specs

        use_te = self.uses_te(use_te)
        if use_te and self.moe is not None:  # dense and sparse layers, this stage's slice
            spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                                              normalization="RMSNorm", vp_stage=vp_stage)
        elif use_te:
            spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                qk_layernorm=config.qk_layernorm, multi_latent_attention=self.mla is not None)
        else:
            from megarl.models.local_spec import local_block_spec

            if self.moe is not None:
                layers = gpt_layer_specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=False,
                                                                     normalization="RMSNorm")
            else:
                layers = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                                                  normalization="RMSNorm")
            spec = local_block_spec(layers, config, vp_stage=vp_stage)
        if self.linear_attention is not None:
            spec = self._with_linear_attention(spec, config, vp_stage, use_te)
        for layer in getattr(spec, "layer_specs", None) or [spec]:
            if not linear_mixer(layer):
                self.attention.adapt_layer(layer)  # (the full-attention layers of a hybrid model)
        return spec

    def _with_linear_attention(self, spec, config, vp_stage: int | None, use_te: bool):
        """``spec`` (this stage's block, or TransformerEngine's one layer spec for every layer) with the Gated DeltaNet
        mixer in its linear-attention layers (:meth:`LinearAttentionSpec.adapt_layers`)."""
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        if not isinstance(spec, TransformerBlockSubmodules):  # TE's dense layer spec: a block of this stage's layers
            from megatron.core.extensions.transformer_engine import TENorm

            spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                              layer_norm=TENorm)
        self.linear_attention.adapt_layers(spec.layer_specs, config.linear_attention_freq,
                                           get_transformer_layer_offset(config, vp_stage=vp_stage), use_te=use_te)
        return spec


def sglang_padded_vocab(vocab_size: int, tp: int, padding: int = 64) -> int:
    """SGLang's padded vocabulary size for ``tp`` ranks (each holds an equal share)."""
    padded = math.ceil(vocab_size / padding) * padding
    if padded % tp != 0:
        padding *= tp
        padded = math.ceil(vocab_size / padding) * padding
    return padded


def _te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _importable(module: str) -> bool:
    """Whether ``module`` imports (an optional compiled extension)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _te_at_least(version: str) -> bool:
    """Whether TransformerEngine of at least ``version`` is installed (Megatron's own check)."""
    try:
        from megatron.core.utils import is_te_min_version

        return bool(is_te_min_version(version))
    except Exception:  # noqa: BLE001 - no TE, or none readable: the fusion stays off
        return False


FAMILIES: dict[str, ModelFamily] = {}
"""Registry: HF architecture name -> family entry."""


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the registry under each of its architectures."""
    for arch in family.architectures + family.classifier_architectures:
        if arch in FAMILIES:
            raise ValueError(f"architecture {arch} is already served by the {FAMILIES[arch].name} family")
        FAMILIES[arch] = family
    return family


def family_for(hf_config) -> ModelFamily:
    """The family serving ``hf_config.architectures[0]`` (or its ``model_type``)."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    model_type = getattr(hf_config, "model_type", None)
    for family in FAMILIES.values():
        if family.name == model_type or model_type in {a.removesuffix("ForCausalLM").lower() for a in family.architectures}:
            return family
    for key in (*archs, model_type):
        if key in UNMAPPED:
            raise ValueError(UNMAPPED[key](hf_config))
    supported = ", ".join(sorted(FAMILIES))
    raise ValueError(
        f"no megarl model family serves architectures={archs} (model_type={model_type!r}); "
        f"supported architectures: {supported}"
    )


def _no_megatron_layer(name: str, key: str, kinds: dict[str, str]):
    """The refusal of a model whose ``key`` (per-layer kinds) names layers Megatron-Core has none of."""

    def refuse(hf_config) -> str:
        used = sorted(set(getattr(hf_config, key, None) or []) & set(kinds)) or sorted(kinds)
        return (f"{name} is not supported: its {key} use {', '.join(f'{k} ({kinds[k]})' for k in used)}, for which "
                "Megatron-Core 0.16 has no layer, so megarl cannot build, shard or train it")

    return refuse


UNMAPPED = {
    arch: _no_megatron_layer("DeepSeek-V4 (" + arch + ")", "layer_types", {
        "compressed_sparse_attention": "keys and values compressed 4:1 with a sparse indexer",
        "heavily_compressed_attention": "keys and values compressed 128:1",
        "sliding_attention": "a local window beside the compressed branches"})
    for arch in ("DeepseekV4ForCausalLM", "deepseek_v4")
}
"""HF architectures (and model types) megarl knows it cannot map, with the reason :func:`family_for` gives."""
