"""Mixtral family: Llama/Mistral attention with a mixture of experts in every layer (``block_sparse_moe``, experts
``w1`` gate, ``w3`` up, ``w2`` down), top-k routing weights always renormalised."""

from megarl.models.family import ModelFamily, register
from megarl.models.moe import MoESpec
from megarl.models.weights import decoder_weights

MIXTRAL_EXPERTS = MoESpec(experts_key="num_local_experts", ffn_key="intermediate_size", block="block_sparse_moe",
                          expert_tensors=("w1", "w3", "w2"))

MIXTRAL = register(
    ModelFamily(
        name="mixtral",
        architectures=("MixtralForCausalLM",),
        bias_settings=(),
        weights=decoder_weights(qkv_bias=False, qk_norm=False, moe=MIXTRAL_EXPERTS),
        moe=MIXTRAL_EXPERTS,
    )
)
