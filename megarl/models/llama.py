"""Llama family: Llama 2/3.x (incl. Llama 3 RoPE scaling), Mistral, SmolLM2 — no biases, GQA."""

from megarl.models.family import ModelFamily, register

LLAMA = register(
    ModelFamily(
        name="llama",
        architectures=("LlamaForCausalLM", "MistralForCausalLM"),
        qkv_bias=lambda hf_config: False,
        # attention_bias also biases o_proj, which Megatron's GPT layer cannot hold alone.
        bias_settings=("attention_bias", "mlp_bias"),
    )
)
