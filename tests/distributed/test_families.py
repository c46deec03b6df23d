"""Each family's HF config maps to a Megatron model with exactly the HF parameter count."""

import pytest

from megarl.parallel.launch import run_ranks

SMALL = dict(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=3, max_position_embeddings=512)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    llama3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
    return {
        "llama-gqa-untied-rope-scaled": LlamaConfig(
            **{**SMALL, "max_position_embeddings": 131072}, num_attention_heads=6, num_key_value_heads=2,
            rope_theta=500000.0, rope_scaling=llama3, tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"]),
        "smollm2-like-tied": LlamaConfig(
            **SMALL, num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True,
            architectures=["LlamaForCausalLM"]),
        "mistral": MistralConfig(
            **SMALL, num_attention_heads=8, num_key_value_heads=2, sliding_window=None,
            architectures=["MistralForCausalLM"]),
        "qwen2-tied-bias": Qwen2Config(
            **SMALL, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
            architectures=["Qwen2ForCausalLM"]),
        "qwen2-untied-bias": Qwen2Config(
            **SMALL, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
            architectures=["Qwen2ForCausalLM"]),
        "qwen3-head-dim": Qwen3Config(
            **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=40, tie_word_embeddings=True,
            architectures=["Qwen3ForCausalLM"]),
    }


def count_job():
    from transformers import AutoModelForCausalLM

    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, init_parallel

    groups = init_parallel(ParallelDims(tp=1, pp=1))
    out = {}
    for name, cfg in _configs().items():
        family = family_for(cfg)
        (model,) = build_model_chunks(family, cfg, groups.dims)
        padded = family.padded_vocab_size(cfg, tp=1)
        embeddings = 1 if cfg.tie_word_embeddings else 2
        megatron = sum(p.numel() for p in model.parameters()) - (padded - cfg.vocab_size) * cfg.hidden_size * embeddings
        hf_model = AutoModelForCausalLM.from_config(cfg)
        hf = sum(p.numel() for p in hf_model.parameters())
        hf_inv_freq = hf_model.model.rotary_emb.inv_freq
        rope_diff = (model.rotary_pos_emb.inv_freq - hf_inv_freq).abs().max() / hf_inv_freq.abs().max()
        out[name] = (family.name, megatron, hf, rope_diff.item())
    return out


@pytest.fixture(scope="module")
def counts():
    return run_ranks(count_job, 1, timeout_s=180)[0]


def test_every_config_was_counted(counts):
    assert set(counts) == set(_configs())
    assert {family for family, *_ in counts.values()} == {"llama", "qwen2", "qwen3"}


@pytest.mark.parametrize("name", list(_configs()))
def test_parameter_count_equals_hf(counts, name):
    _, megatron, hf, _ = counts[name]
    assert megatron == hf


@pytest.mark.parametrize("name", list(_configs()))
def test_rope_frequencies_equal_hf(counts, name):
    assert counts[name][3] <= 1e-6
