"""Qwen3 family: per-head RMSNorm on queries and keys, explicit head_dim, no biases."""

from megarl.models.family import ModelFamily, register
from megarl.models.weights import decoder_weights

QWEN3 = register(
    ModelFamily(
        name="qwen3",
        architectures=("Qwen3ForCausalLM",),
        # attention_bias also biases o_proj, which Megatron's GPT layer cannot hold alone.
        bias_settings=("attention_bias",),
        weights=decoder_weights(qkv_bias=False, qk_norm=True),
    )
)
