"""Qwen3-MoE family: Qwen3's attention (per-head q/k RMSNorm, explicit head_dim, no biases) with mixture-of-experts
MLPs; ``decoder_sparse_step`` and ``mlp_only_layers`` keep some layers dense; ``norm_topk_prob`` says whether the
top-k routing weights are renormalised. No shared experts."""

from megarl.models.family import ModelFamily, register
from megarl.models.moe import MoESpec
from megarl.models.weights import decoder_weights

QWEN3_MOE_EXPERTS = MoESpec(experts_key="num_experts", ffn_key="moe_intermediate_size", norm_topk_key="norm_topk_prob",
                            sparse_step_key="decoder_sparse_step", dense_layers_key="mlp_only_layers")

QWEN3_MOE = register(
    ModelFamily(
        name="qwen3_moe",
        architectures=("Qwen3MoeForCausalLM",),
        bias_settings=("attention_bias",),
        weights=decoder_weights(qkv_bias=False, qk_norm=True, moe=QWEN3_MOE_EXPERTS),
        moe=QWEN3_MOE_EXPERTS,
    )
)
