"""Qwen2 / Qwen2.5 family: biases on the q/k/v projections only."""

from megarl.models.family import ModelFamily, register
from megarl.models.weights import decoder_weights

QWEN2 = register(
    ModelFamily(
        name="qwen2",
        architectures=("Qwen2ForCausalLM",),
        bias_settings=(),
        weights=decoder_weights(qkv_bias=True, qk_norm=False),
    )
)
