"""Architectures megarl knows by name, so the planner can size a model it cannot download.

``megarl-plan`` needs a model's sizes (hidden, layers, heads, vocabulary, ...) but recipes name
hub ids (``Qwen/Qwen2.5-7B-Instruct``) and there may be no hub. :func:`resolve_hf_config` reads
the model directory's ``config.json`` when ``path`` exists locally, and otherwise matches the
path's last component against :data:`KNOWN_ARCHITECTURES` (``-Instruct`` variants share their
base model's sizes). The entries copy the published ``config.json`` values that decide sizes;
they are HF configs good for counting parameters and KV-cache bytes, not for loading weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SIZE_LIMITS = {"num_hidden_layers": 1024, "hidden_size": 1 << 17, "num_attention_heads": 1 << 12,
               "num_key_value_heads": 1 << 12, "intermediate_size": 1 << 20, "vocab_size": 1 << 23, "head_dim": 1 << 12,
               "num_experts": 1 << 12, "num_local_experts": 1 << 12, "num_experts_per_tok": 1 << 12,
               "moe_intermediate_size": 1 << 20}
"""Largest accepted value of each size field. Far above any published model (≤ 128 layers, hidden ≤ 25,600,
vocabularies ≤ 262,144, ≤ 512 routed experts); a value past it is a typo or a corrupt file, and would make
transformers' config classes and the planner build per-layer (per-expert) lists of that length (10⁸ layers hung
inside the HF config)."""
REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")

KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    "Qwen2.5-7B": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
        tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    "Llama-3.1-8B": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
    ),
    # A reward model on Llama-3.1-8B's body and tokenizer (Skywork/Skywork-Reward-Llama-3.1-8B-v0.2's config.json: a
    # LlamaForSequenceClassification with one label).
    "Skywork-Reward-Llama-3.1-8B-v0.2": dict(
        model_type="llama", architectures=["LlamaForSequenceClassification"], hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, num_labels=1,
        tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
    ),
    "Llama-3.1-70B": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8192, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
    ),
    # Qwen/Qwen3-30B-A3B's config.json on the hub (its model card: 30.5 B parameters, 3.3 B activated, 48 layers,
    # 32 query / 4 KV heads, 128 experts, 8 activated); the same numbers as slime's scripts/models/qwen3-30B-A3B.sh
    # (layers, hidden, heads, kv channels, ffn sizes, experts, top-k, vocabulary, untied) and vLLM's Qwen3-MoE test
    # config (max_position_embeddings, rope_theta, decoder_sparse_step, mlp_only_layers, norm_topk_prob).
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    # deepseek-ai/DeepSeek-V3's config.json on the hub (model card: 671 B parameters of the main model, 37 B
    # activated per token, plus a 14 B multi-token-prediction module): 61 layers, the first 3 dense, 256 routed
    # experts (8 per token, 8 groups of which 4) and one shared, multi-latent attention with YaRN (factor 40).
    "DeepSeek-V3": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        first_k_dense_replace=3, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, tie_word_embeddings=False,
        max_position_embeddings=163840, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, rope_theta=10000,
    ),
    # Qwen/Qwen3-235B-A22B's config.json on the hub (model card: 235 B parameters, 22 B activated, 94 layers, 64
    # query / 4 KV heads, 128 experts of which 8 per token): every layer a mixture of experts, no shared expert.
    "Qwen3-235B-A22B": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=4096, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
        moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    # zai-org/GLM-4.5's config.json on the hub (model card: 355 B parameters, 32 B active): 92 layers, the first 3
    # dense, 160 routed experts (8 per token, sigmoid with a bias, scaled 2.5) and one shared, 96 query / 8 KV heads
    # with q/k/v biases and q/k norms, rotary on half of each head; one multi-token-prediction layer (not trained).
    "GLM-4.5": dict(
        model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], hidden_size=5120, num_hidden_layers=92,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
        moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=3, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=True, vocab_size=151552, tie_word_embeddings=False,
        max_position_embeddings=131072, rms_norm_eps=1e-5, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    ),
    # moonshotai/Kimi-K2-Instruct's config.json on the hub (model card: 1 T total parameters, 32 B activated):
    # DeepSeek-V3's architecture (its model_type kimi_k2 is read as deepseek_v3: megarl.models.hf_config) with 64
    # heads, 384 routed experts in one group, one dense layer, a 163,840-token vocabulary, YaRN factor 32 from 4,096
    # (131,072 positions), and no multi-token-prediction layer.
    "Kimi-K2": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, num_hidden_layers=61,
        num_attention_heads=64, num_key_value_heads=64, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.827, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840, tie_word_embeddings=False,
        max_position_embeddings=131072, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
        rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, rope_theta=50000.0,
    ),
    # MiniMaxAI/MiniMax-M2's config.json on the hub (model card: 230 B total parameters, 10 B activated): 62 layers,
    # each a mixture of 256 experts (8 per token, sigmoid scores with a routing bias), 48 query / 8 KV heads of 128
    # with q/k norms over all heads, rotary on 64 of each head's 128 dimensions; three multi-token-prediction modules
    # (not trained). The keys SGLang reads (use_qk_norm, use_routing_bias, scoring_func, rotary_dim) as published.
    "MiniMax-M2": dict(
        model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"], hidden_size=3072, num_hidden_layers=62,
        num_attention_heads=48, num_key_value_heads=8, head_dim=128, intermediate_size=1536, num_local_experts=256,
        num_experts_per_tok=8, vocab_size=200064, tie_word_embeddings=False, max_position_embeddings=196608,
        rms_norm_eps=1e-6, rope_theta=5000000, rotary_dim=64, use_qk_norm=True, qk_norm_type="per_layer",
        use_routing_bias=True, scoring_func="sigmoid", num_mtp_modules=3, mtp_transformer_layers=1,
        shared_intermediate_size=0,
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json on the hub (model card: 80 B parameters, 3 B activated; 48
    # layers in a 3:1 pattern of Gated DeltaNet and gated attention, 512 experts of which 10 per token and one
    # shared, 16 query / 2 KV heads of 256, linear attention 16 key / 32 value heads of 128): the values
    # transformers 5.24's Qwen3NextConfig gives as that checkpoint's.
    "Qwen3-Next-80B-A3B": dict(
        model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, intermediate_size=5120,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        full_attention_interval=4, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=262144,
        rms_norm_eps=1e-6, rope_theta=10000000, partial_rotary_factor=0.25,
    ),
    # Qwen/Qwen3.5-35B-A3B's text model (its config.json's text_config): 40 layers in the same 3:1 pattern, 256
    # experts of which 8 per token and one shared, 16 query / 2 KV heads of 256, a 248,320-token vocabulary: the
    # values transformers 5.24's Qwen3_5MoeTextConfig gives as that checkpoint's.
    "Qwen3.5-35B-A3B": dict(
        model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], hidden_size=2048,
        num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        full_attention_interval=4, vocab_size=248320, tie_word_embeddings=False, max_position_embeddings=262144,
        rms_norm_eps=1e-6,
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct's config.json on the hub: Qwen2's 7B language model (q/k/v biases, untied) with
    # multimodal RoPE (sections 16, 24, 24 of the 128-wide heads), and a 32-block vision tower (1280 wide, windowed
    # attention but in blocks 7, 15, 23, 31; 2 x 2 patch merging into the 3584-wide language model).
    "Qwen2.5-VL-7B": dict(
        model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], tie_word_embeddings=False,
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        text_config=dict(
            hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
            intermediate_size=18944, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision_config=dict(
            depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
            tokens_per_second=2, hidden_act="silu",
        ),
    ),
}
"""Base-model name -> the size-deciding fields of its HF ``config.json`` (a vision-language model's language sizes
in its ``text_config``) (Qwen2.5: q/k/v biases, which
the ``qwen2`` family adds; Llama 3.1: none; a reward model: its sequence-classification architecture; Qwen3-30B-A3B: a mixture of experts in every layer, no shared
expert)."""

_VARIANT_SUFFIXES = ("-instruct",)


def known_name(path: str) -> str | None:
    """The :data:`KNOWN_ARCHITECTURES` entry whose name is ``path``'s last component (case-insensitive,
    an ``-Instruct`` suffix ignored); None when none is."""
    base = Path(str(path).rstrip("/")).name.lower()
    for suffix in _VARIANT_SUFFIXES:
        base = base.removesuffix(suffix)
    for name in KNOWN_ARCHITECTURES:
        if name.lower() == base:
            return name
    return None


def known_config(name: str):
    """The HF config of the known architecture ``name`` (a key of :data:`KNOWN_ARCHITECTURES`)."""
    from transformers import AutoConfig

    from megarl.models.vision import model_config

    fields = dict(KNOWN_ARCHITECTURES[name])
    return model_config(AutoConfig.for_model(fields.pop("model_type"), **fields))


def check_sizes(fields: dict[str, Any], *, source: str, key: str) -> None:
    """Refuse a config whose size fields are missing, not positive integers, past :data:`SIZE_LIMITS`, or
    with attention heads that key/value heads do not divide; the error names ``key``, the file and the field."""
    for name, limit in SIZE_LIMITS.items():
        if name not in fields or fields[name] is None:
            # (a mixture of experts in every layer may name only its experts' size: Qwen3.5-MoE, Qwen3-Next)
            if name in REQUIRED_SIZES and not (name == "intermediate_size" and fields.get("moe_intermediate_size")):
                raise ValueError(f"{key}: {source} has no {name}; an HF causal-LM config needs it")
            continue
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise ValueError(f"{key}: {source} has {name}={value!r}; it must be an integer from 1 to {limit}")
    heads, kv_heads = fields["num_attention_heads"], fields.get("num_key_value_heads") or fields["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"{key}: {source} has num_attention_heads={heads} not divisible by "
                         f"num_key_value_heads={kv_heads}")


def resolve_hf_config(path: str, *, key: str):
    """``(hf_config, source)`` for the model at ``path``: its ``config.json`` when the directory exists
    here, else the known architecture its name matches. ``key`` names the setting in errors."""
    local = Path(str(path)).expanduser()
    if (local / "config.json").is_file():
        from megarl.models.hf_config import load_hf_config

        source = str(local / "config.json")
        try:
            fields = json.loads((local / "config.json").read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{key}: {source} is not readable JSON: {error}") from error
        check_sizes(fields.get("text_config", fields) if isinstance(fields, dict) else {}, source=source, key=key)
        return load_hf_config(local), source
    name = known_name(str(path))
    if name is None:
        raise ValueError(
            f"{key}={path!r}: no config.json there and the name matches no known architecture "
            f"({', '.join(KNOWN_ARCHITECTURES)}, optionally with -Instruct): point {key} at a local HF model "
            f"directory, or add the architecture to megarl.models.known.KNOWN_ARCHITECTURES"
        )
    return known_config(name), f"known architecture {name} (megarl.models.known)"
