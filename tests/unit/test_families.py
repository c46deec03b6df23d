"""HF config -> TransformerConfig mapping per family, and the errors for what cannot map."""

import json
import re
import warnings

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from megarl.models import FAMILIES, family_for
from megarl.parallel import ParallelDims


def llama(**kw):
    base = dict(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"])
    return LlamaConfig(**{**base, **kw})


def test_registry_is_keyed_by_architecture():
    causal = {
        "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
        "Glm4MoeForCausalLM": "glm4_moe", "DeepseekV3ForCausalLM": "deepseek_v3", "MiniMaxM2ForCausalLM": "minimax_m2",
        "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5MoeForCausalLM": "qwen3_5_moe", "Qwen3NextForCausalLM": "qwen3_next",
    }
    # Each causal LM's body also serves its sequence-classification model (a reward model's score head).
    classifiers = {a.replace("ForCausalLM", "ForSequenceClassification"): f for a, f in causal.items()}
    multimodal = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Qwen3VLForConditionalGeneration": "qwen3_vl"}
    assert {a: f.name for a, f in FAMILIES.items()} == causal | classifiers | multimodal
    assert family_for(Qwen2Config()).name == "qwen2"  # no architectures: model_type decides
    assert family_for(MistralConfig()).name == "llama"


def _moe(kind: str, **kw):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    if kind == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                                "architectures": ["MixtralForCausalLM"], **kw})
    return Qwen3MoeConfig(**{**common, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 24,
                             "num_experts": 8, "num_experts_per_tok": 2, "architectures": ["Qwen3MoeForCausalLM"], **kw})


@pytest.mark.parametrize("kind, kw, pre_softmax, freq", [
    ("qwen3_moe", {"norm_topk_prob": True}, False, 1),
    ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [0, 2]}, True, [0, 1, 0, 1]),
    ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2}, False, [0, 1, 0, 1]),
    ("mixtral", {}, False, 1),
])
def test_moe_config_maps_experts_router_and_sparse_layers(kind, kw, pre_softmax, freq):
    cfg = _moe(kind, **kw)
    family = family_for(cfg)
    config = family.transformer_config(cfg, ParallelDims(tp=1, pp=1))
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_router_score_function) == (8, 2, "softmax")
    assert config.moe_ffn_hidden_size == (32 if kind == "mixtral" else 24)
    assert config.ffn_hidden_size == (32 if kind == "mixtral" else 96)  # dense layers' MLP
    assert config.moe_router_pre_softmax is pre_softmax  # HF renormalises the top-k weights <=> softmax after top-k
    assert config.moe_layer_freq == freq
    # The weight map: every sparse layer a router and 8 experts' fc1/fc2, every dense one its MLP.
    names = [at.megatron_name for at in family.weight_instances(cfg)]
    sparse = [f == 1 for f in freq] if isinstance(freq, list) else [True] * 4
    for layer, is_sparse in enumerate(sparse):
        assert (f"decoder.layers.{layer}.mlp.router.weight" in names) is is_sparse
        assert (f"decoder.layers.{layer}.mlp.experts.local_experts.7.linear_fc2.weight" in names) is is_sparse
        assert (f"decoder.layers.{layer}.mlp.linear_fc1.weight" in names) is not is_sparse
        assert names.count(f"decoder.layers.{layer}.pre_mlp_layernorm.weight") == 1
    hf = [n for at in family.weight_instances(cfg) for n in at.hf_names]
    expert = "block_sparse_moe.experts.3.w3" if kind == "mixtral" else "mlp.experts.3.up_proj"
    assert f"model.layers.{sparse.index(True)}.{expert}.weight" in hf and len(hf) == len(set(hf))


@pytest.mark.parametrize("kw, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 in the HF config: it must be in 1..num_experts=8"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 in the HF config"),
])
def test_moe_configs_megarl_cannot_map_are_refused(kw, message):
    cfg = _moe("mixtral" if "jitter" in str(kw) else "qwen3_moe", **kw)
    with pytest.raises(ValueError, match=message):
        family_for(cfg).transformer_config(cfg, ParallelDims(tp=1, pp=1))


def test_unknown_architecture_lists_supported():
    cfg = llama(architectures=["GPT2LMHeadModel"])
    cfg.model_type = "gpt2"
    with pytest.raises(ValueError, match=r"no megarl model family serves architectures=\['GPT2LMHeadModel'\].*LlamaForCausalLM"):
        family_for(cfg)


def test_llama_gqa_mapping():
    cfg = llama()
    tc = family_for(cfg).transformer_config(cfg, ParallelDims(tp=2, pp=2))
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (4, 128, 352)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (8, 2, 16)
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size) == (2, 2)
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-5
    assert tc.gated_linear_unit and tc.activation_func is torch.nn.functional.silu
    assert not tc.add_bias_linear and not tc.add_qkv_bias and not tc.qk_layernorm
    assert tc.calculate_per_token_loss and tc.hidden_dropout == 0.0 and tc.use_cpu_initialization


def test_qwen2_has_qkv_bias_and_qwen3_has_qk_norm_and_head_dim():
    q2 = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=96)
    tc2 = family_for(q2).transformer_config(q2, ParallelDims())
    assert tc2.add_qkv_bias and not tc2.add_bias_linear and not tc2.qk_layernorm and tc2.kv_channels == 16
    q3 = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=40, num_hidden_layers=2,
                     intermediate_size=96)
    tc3 = family_for(q3).transformer_config(q3, ParallelDims())
    assert tc3.qk_layernorm and not tc3.add_qkv_bias and tc3.kv_channels == 40


def test_overrides_win():
    cfg = llama()
    tc = family_for(cfg).transformer_config(cfg, ParallelDims(), params_dtype=torch.bfloat16, recompute_granularity="full",
                                            recompute_method="uniform", recompute_num_layers=1)
    assert tc.params_dtype == torch.bfloat16 and tc.bf16 and tc.pipeline_dtype == torch.bfloat16
    assert tc.recompute_granularity == "full"


def test_vocab_padded_to_tp_multiple():
    family = family_for(llama())
    assert family.padded_vocab_size(llama(vocab_size=1000), tp=1) == 1024
    assert family.padded_vocab_size(llama(vocab_size=1000), tp=2) == 1024
    assert family.padded_vocab_size(llama(vocab_size=1000), tp=8) == 1024
    assert family.padded_vocab_size(llama(vocab_size=151936), tp=8) == 151936
    assert family.padded_vocab_size(llama(vocab_size=128256), tp=8) == 128256
    # 1024 is not divisible by 3, so SGLang pads to a multiple of 64 × 3 = 192
    assert family.padded_vocab_size(llama(vocab_size=1001), tp=3) == 1152


def test_rope_arguments():
    family = family_for(llama())
    assert family.rope_kwargs(llama(rope_theta=500000.0)) == {"position_embedding_type": "rope", "rotary_base": 500000.0}
    scaled = llama(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
    assert family.rope_kwargs(scaled) == {"position_embedding_type": "rope", "rotary_base": 500000.0,
                                          "rope_scaling": True, "rope_scaling_factor": 8.0}
    linear = llama(rope_scaling=dict(rope_type="linear", factor=4.0))
    assert family.rope_kwargs(linear)["seq_len_interpolation_factor"] == 4.0


@pytest.mark.parametrize(
    "cfg, message",
    [
        (llama(hidden_act="gelu"), r"hidden_act='gelu' in the HF config is not supported"),
        (llama(attention_bias=True), r"attention_bias=true in the HF config"),
        (llama(mlp_bias=True), r"mlp_bias=true in the HF config"),
        (llama(max_position_embeddings=131072, rope_scaling=dict(rope_type="yarn", factor=4.0,
               original_max_position_embeddings=8192)), r"rope_scaling.rope_type='yarn' .* not supported"),
        (llama(max_position_embeddings=131072, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
               high_freq_factor=4.0, original_max_position_embeddings=4096)),
         r"rope_scaling.original_max_position_embeddings=4096 .* fixed at original_max_position_embeddings=8192"),
    ],
)
def test_unsupported_configs_are_refused_by_name(cfg, message):
    family = family_for(llama())
    with pytest.raises(ValueError, match=message):
        family.transformer_config(cfg, ParallelDims())
        family.gpt_model_kwargs(cfg, ParallelDims())


def test_layout_errors_name_the_setting():
    cfg = llama(num_attention_heads=6, num_key_value_heads=6, hidden_size=96)
    family = family_for(cfg)
    with pytest.raises(ValueError, match=r"parallel.tp=4 does not divide the model's 6 attention heads"):
        family.transformer_config(cfg, ParallelDims(tp=4))
    with pytest.raises(ValueError, match=r"parallel.pp × parallel.vpp = 8 pipeline chunks exceed the model's 4 layers"):
        family.transformer_config(cfg, ParallelDims(pp=8))


def test_sliding_window_is_reported_not_silently_dropped():
    cfg = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                        intermediate_size=96, sliding_window=16, max_position_embeddings=64)
    with pytest.warns(UserWarning, match="sliding_window=16 in the HF config is ignored"):
        family_for(cfg).transformer_config(cfg, ParallelDims())
    qwen = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=96, use_sliding_window=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        family_for(qwen).transformer_config(qwen, ParallelDims())


def test_skipping_initialisation_is_refused_on_cpu():
    # Megatron sets TP attributes of linear weights only while initialising them on CPU;
    # without them the gradient norm silently counts sharded weights once (measured: 1.90 vs 2.94).
    cfg = llama()
    with pytest.raises(ValueError, match="perform_initialization=False is not supported on CPU"):
        family_for(cfg).transformer_config(cfg, ParallelDims(), perform_initialization=False)


def test_moe_checkpoint_shapes_follow_megatrons_layout():
    """The keys and global shapes of a Megatron checkpoint (as hf-to-mcore writes them, seen in its metadata):
    layers stacked when every layer is sparse, one key per layer when dense ones alternate; experts on one axis;
    a sparse layer's pre-MLP norm under TransformerEngine's MoE name."""
    from megarl.convert.preflight import expected_mcore_shapes

    cfg = _moe("mixtral", num_local_experts=4)
    shapes = {k: v[0] for k, v in expected_mcore_shapes(family_for(cfg), cfg, tp=2).items()}
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 4, 64, 64)  # [L, E, 2F, H]
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (4, 4, 64, 32)
    assert shapes["decoder.layers.mlp.router.weight"] == (4, 4, 64)
    assert shapes["decoder.layers.pre_mlp_layernorm.weight"] == (4, 64)
    cfg = _moe("qwen3_moe", mlp_only_layers=[1])
    shapes = {k: v[0] for k, v in expected_mcore_shapes(family_for(cfg), cfg, tp=1).items()}
    assert shapes["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == (8, 48, 64)
    assert shapes["decoder.layers.1.mlp.linear_fc1.weight"] == (192, 64)
    assert "decoder.layers.1.mlp.router.weight" not in shapes and "decoder.layers.linear_qkv.weight" not in shapes


def _glm(**kw):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**{"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
                            "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 2,
                            "num_experts_per_tok": 4, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                            "n_group": 1, "topk_group": 1, "architectures": ["Glm4MoeForCausalLM"], **kw})


def test_glm4_moe_maps_sigmoid_routing_its_bias_scaling_groups_and_shared_experts():
    cfg = _glm(n_group=2, topk_group=2)
    family = family_for(cfg)
    config = family.transformer_config(cfg, ParallelDims(tp=1, pp=1))
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert config.moe_router_bias_update_rate == 0.0 and config.moe_router_topk_scaling_factor == 2.5
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 2)
    assert config.moe_shared_expert_intermediate_size == 2 * 24 and not config.moe_shared_expert_gate
    assert config.moe_layer_freq == [0, 1, 1, 1]  # first_k_dense_replace=1
    assert family.gpt_model_kwargs(cfg, ParallelDims(tp=1))["rotary_percent"] == 0.5
    names = {at.megatron_name: at.hf_names for at in family.weight_instances(cfg)}
    assert names["decoder.layers.1.mlp.router.expert_bias"] == ("model.layers.1.mlp.gate.e_score_correction_bias",)
    assert names["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == (
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight")
    # GLM-4.5's per-head q/k norms exist under use_qk_norm (GLM-4.5-Air has none): rules and Megatron's layer norms
    assert not config.qk_layernorm and "decoder.layers.0.self_attention.q_layernorm.weight" not in names
    normed = _glm(use_qk_norm=True)
    assert family.transformer_config(normed, ParallelDims(tp=1, pp=1)).qk_layernorm
    names = {at.megatron_name: at.hf_names for at in family.weight_instances(normed)}
    assert names["decoder.layers.0.self_attention.k_layernorm.weight"] == ("model.layers.0.self_attn.k_norm.weight",)
    with pytest.raises(ValueError, match="n_group=2, topk_group=1 with num_experts_per_tok=4 .* top 2"):
        family.transformer_config(_glm(n_group=2, topk_group=1), ParallelDims(tp=1, pp=1))
    with pytest.raises(ValueError, match="norm_topk_prob=false in the HF config: Megatron renormalises a sigmoid"):
        family.transformer_config(_glm(norm_topk_prob=False), ParallelDims(tp=1, pp=1))


def test_routed_token_counts_leave_padding_out():
    """The expert-bias update's counts (megarl.models.moe.count_routed_tokens): a ``[T, E]`` routing map with a
    ``[T]`` or ``[b, s]`` padding mask (True on padding; Megatron-Core 0.16.1's own counting fails to broadcast it
    unless T = E), in fp32 (a bf16 count rounds whole numbers past 256)."""
    from megarl.models.moe import count_routed_tokens

    routing = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    padding = torch.tensor([False, False, True, False, True])
    assert count_routed_tokens(routing, None).tolist() == [3.0, 3.0, 3.0]
    assert count_routed_tokens(routing, padding).tolist() == [2.0, 3.0, 1.0]
    assert count_routed_tokens(routing, padding.reshape(1, 5)).dtype == torch.float32
    big = torch.ones(300, 2, dtype=torch.bool)
    assert count_routed_tokens(big, None).tolist() == [300.0, 300.0]


def _deepseek(**kw):
    from transformers import DeepseekV3Config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24,
                kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, routed_scaling_factor=2.5,
                max_position_embeddings=163840, rope_parameters=rope, architectures=["DeepseekV3ForCausalLM"])
    return DeepseekV3Config(**{**base, **kw})


def test_deepseek_v3_maps_onto_megatrons_multi_latent_attention():
    """DeepSeek-V3's attention sizes and YaRN onto MLATransformerConfig: Megatron's ``qk_head_dim`` is HF's
    ``qk_nope_head_dim``, the core attention's width the value head (HF's ``head_dim`` is the rotary width), every
    head its own keys; its router like GLM-4.5's; the rotary embedding MLA's own."""
    from megatron.core.transformer import MLATransformerConfig

    from megarl.parallel import ParallelDims

    cfg = _deepseek()
    family = family_for(cfg)
    config = family.transformer_config(cfg, ParallelDims())
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim, config.kv_channels, config.num_query_groups) == (24, 16, 12, 8, 10, 10, 4)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim,
            config.original_max_position_embeddings, config.beta_fast) == ("yarn", 40.0, 1.0, 1.0, 4096, 32.0)
    assert config.qk_layernorm and not config.rotary_interleaved
    assert (config.moe_router_score_function, config.moe_router_num_groups, config.moe_router_group_topk,
            config.moe_router_topk_scaling_factor, config.moe_layer_freq) == ("sigmoid", 4, 2, 2.5, [0, 1, 1, 1])
    assert family.gpt_model_kwargs(cfg, ParallelDims())["position_embedding_type"] == "none"
    names = {at.megatron_name: at.hf_names for at in family.weight_instances(cfg)}
    assert names["decoder.layers.0.self_attention.linear_kv_down_proj.weight"] == (
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",)
    assert names["decoder.layers.1.mlp.router.expert_bias"] == ("model.layers.1.mlp.gate.e_score_correction_bias",)
    plain = family_for(_deepseek(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    config = plain.transformer_config(_deepseek(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                                      ParallelDims())
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale_all_dim) == ("rope", 1.0, 0.0)


@pytest.mark.parametrize("kw, key", [
    (dict(q_lora_rank=None), "q_lora_rank=null"),
    (dict(rope_interleave=False), "rope_interleave=false"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type='linear'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "truncate": False}),
     "truncate=false"),
])
def test_deepseek_v3_refuses_what_it_does_not_map_naming_the_key(kw, key):
    from megarl.parallel import ParallelDims

    cfg = _deepseek(**kw)
    with pytest.raises(ValueError, match=re.escape(key)):
        family_for(cfg).transformer_config(cfg, ParallelDims())
    with pytest.raises(ValueError, match="attention_bias=true"):
        bias = _deepseek(attention_bias=True)
        family_for(bias).transformer_config(bias, ParallelDims())



def test_kimi_k2s_model_type_is_read_as_deepseek_v3_and_its_config_kept(tmp_path):
    """Kimi-K2's checkpoints say ``model_type: kimi_k2`` (unknown to transformers, with an ``auto_map`` to the
    repository's config code) and ``DeepseekV3ForCausalLM``: megarl reads them with DeepSeek-V3's config class,
    every field kept; the HF engine loads the model; an export keeps the checkpoint's own ``config.json`` (its
    ``model_type``, which SGLang reads), only the dtype set. An unknown ``model_type`` no family names still fails
    as transformers says (naming ``trust_remote_code``)."""
    from transformers import AutoModelForCausalLM

    from megarl.convert.hf_io import set_config_dtype
    from megarl.engines.cpu_engine.hf_engine import HFEngine
    from megarl.engines.engine import SamplingParams
    from megarl.models.hf_config import load_hf_config
    from megarl.models.tiny import build_tiny_tokenizer
    from tests.distributed.moe_jobs import kimi_config

    cfg = _deepseek(vocab_size=64, n_group=1, topk_group=1, routed_scaling_factor=2.827, num_hidden_layers=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    build_tiny_tokenizer(vocab_size=64).save_pretrained(tmp_path)
    kimi_config(tmp_path)
    loaded = load_hf_config(tmp_path)
    assert type(loaded).__name__ == "DeepseekV3Config" and family_for(loaded).name == "deepseek_v3"
    assert (loaded.routed_scaling_factor, loaded.n_group, loaded.q_lora_rank, loaded.num_hidden_layers) == (
        2.827, 1, 24, 2)
    engine = HFEngine(tmp_path)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].output_ids) == 4
    set_config_dtype(tmp_path, torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["dtype"], config["auto_map"]["AutoConfig"]) == (
        "kimi_k2", "bfloat16", "configuration_deepseek.DeepseekV3Config")
    config["model_type"] = "no_such_model"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(?s)contains custom code .*trust_remote_code=True"):
        load_hf_config(tmp_path)  # transformers' own error: the repository's code could read it


@pytest.mark.parametrize("attention_bias", [True, False])
def test_glm4_moe_reads_its_attention_bias_from_the_config(attention_bias):
    """GLM-4.5's published checkpoints set ``attention_bias: true``; transformers' default is false, and a checkpoint
    without the key has no q/k/v biases. The rules, Megatron's ``add_qkv_bias`` and the tensors transformers builds
    agree either way (they were refused as "missing tensors q_proj.bias")."""
    from transformers import AutoModelForCausalLM

    cfg = _glm(attention_bias=attention_bias)
    family = family_for(cfg)
    assert family.qkv_bias(cfg) == attention_bias
    assert family.transformer_config(cfg, ParallelDims(tp=1, pp=1)).add_qkv_bias == attention_bias
    names = {n for at in family.weight_instances(cfg) for n in at.hf_names}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    attention = {n for n in hf.state_dict() if ".self_attn." in n and not family.skipped_tensors(cfg, [n])}
    assert {n for n in names if ".self_attn." in n} == attention  # (transformers 5 fuses its experts' tensors)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == attention_bias


def _minimax(**kw):
    from tests.distributed.moe_jobs import tiny_moe_config

    cfg = tiny_moe_config("minimax_m2")
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


def test_minimax_m2_maps_its_all_heads_qk_norms_sigmoid_router_and_partial_rotary():
    """MiniMax-M2: q/k norms over all heads split by head like the heads (not Megatron's per-head qk_layernorm,
    whose gradient Megatron would sum over TP), never quantized; the MLP block's own routing bias; Mixtral's expert
    names; rotary over half of each head."""
    from megarl.models.attention import AllHeadsRMSNorm
    from megarl.models.weights import Split

    cfg = _minimax()
    family = family_for(cfg)
    assert family.name == "minimax_m2"
    config = family.transformer_config(cfg, ParallelDims(tp=2, ep=2, sequence_parallel=True))
    assert not config.qk_layernorm
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert not config.moe_router_pre_softmax and config.moe_layer_freq == 1
    assert family.gpt_model_kwargs(cfg, ParallelDims(tp=1))["rotary_percent"] == 0.5
    rules = {at.megatron_name: at for at in family.weight_instances(cfg)}
    q_norm = rules["decoder.layers.0.self_attention.q_layernorm.weight"]
    assert q_norm.hf_names == ("model.layers.0.self_attn.q_norm.weight",)
    assert q_norm.rule.split is Split.COLUMN and not q_norm.rule.block_fp8
    assert rules["decoder.layers.2.mlp.router.expert_bias"].hf_names == (
        "model.layers.2.block_sparse_moe.e_score_correction_bias",)
    assert rules["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"].hf_names == (
        "model.layers.2.block_sparse_moe.experts.3.w1.weight", "model.layers.2.block_sparse_moe.experts.3.w3.weight")
    from megatron.core.models.gpt import gpt_layer_specs

    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    family.attention.adapt_layer(spec)  # as block_spec does, after the layer spec's own choices
    attention = spec.submodules.self_attention.submodules
    assert attention.q_layernorm.module is AllHeadsRMSNorm and attention.k_layernorm.params == {"part": "key"}
    from megarl.convert.hf_io import expected_shapes
    from megarl.models.sizes import Architecture

    shapes = Architecture.from_hf(cfg, name="tiny", source="test").hf_shapes()  # the planner's
    assert shapes == {n: expected_shapes(cfg)[n] for n in shapes}  # transformers' own
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (4 * 12,)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (2 * 12,)


@pytest.mark.parametrize("kw, key", [
    (dict(use_qk_norm=False), "use_qk_norm=False in the HF config (want True): SGLang's minimax_m2 model reads it and "
                              "builds the attention without its q/k norms"),
    (dict(use_routing_bias=None), "use_routing_bias=None"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(rotary_dim=12), "rotary_dim=12 in the HF config (want 6)"),
])
def test_minimax_m2_refuses_a_config_sglang_would_serve_as_another_model(kw, key):
    """SGLang's MiniMax-M2 reads use_qk_norm, use_routing_bias, scoring_func and rotary_dim, which transformers does
    not (it always applies the norms and the bias, and derives the rotary width from partial_rotary_factor)."""
    cfg = _minimax(**kw)
    with pytest.raises(ValueError, match=re.escape(key)):
        family_for(cfg).transformer_config(cfg, ParallelDims())


def test_deepseek_v4_is_refused_naming_its_attention_kinds():
    """DeepSeek-V4's compressed attention has no Megatron-Core layer: refused where the family is looked up (the
    run's and megarl-convert's checks, before any rank starts), naming the layer types its config uses."""
    from transformers import DeepseekV4Config

    for cfg in (DeepseekV4Config(num_hidden_layers=4, architectures=["DeepseekV4ForCausalLM"]),
                DeepseekV4Config(num_hidden_layers=4)):
        with pytest.raises(ValueError, match=r"DeepSeek-V4 .* layer_types use compressed_sparse_attention \(keys and "
                                             r"values compressed 4:1.*heavily_compressed_attention.*no layer"):
            family_for(cfg)
