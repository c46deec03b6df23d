"""Qwen2 / Qwen2.5 family: biases on the q/k/v projections only."""

from megarl.models.family import ModelFamily, register

QWEN2 = register(
    ModelFamily(
        name="qwen2",
        architectures=("Qwen2ForCausalLM",),
        qkv_bias=lambda hf_config: True,
        bias_settings=(),
    )
)
