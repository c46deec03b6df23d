"""Llama family: Llama 2/3.x (incl. Llama 3 RoPE scaling), Mistral, SmolLM2 — no biases, GQA."""

from megarl.models.family import ModelFamily, register
from megarl.models.weights import decoder_weights

LLAMA = register(
    ModelFamily(
        name="llama",
        architectures=("LlamaForCausalLM", "MistralForCausalLM"),
        # attention_bias also biases o_proj, which Megatron's GPT layer cannot hold alone.
        bias_settings=("attention_bias", "mlp_bias"),
        weights=decoder_weights(qkv_bias=False, qk_norm=False),
        engine_reads_back=True,
    )
)
