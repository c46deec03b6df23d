"""Qwen2-MoE family (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with mixture-of-experts MLPs and a
shared expert every token goes through, its output gated by ``sigmoid(shared_expert_gate(x))``; ``norm_topk_prob``
says whether the top-k routing weights are renormalised; ``decoder_sparse_step`` and ``mlp_only_layers`` keep some
layers dense."""

from megarl.models.family import ModelFamily, register
from megarl.models.moe import MoESpec
from megarl.models.weights import decoder_weights

QWEN2_MOE_EXPERTS = MoESpec(experts_key="num_experts", ffn_key="moe_intermediate_size", norm_topk_key="norm_topk_prob",
                            sparse_step_key="decoder_sparse_step", dense_layers_key="mlp_only_layers",
                            shared_expert_key="shared_expert_intermediate_size", shared_expert_gate=True)

QWEN2_MOE = register(
    ModelFamily(
        name="qwen2_moe",
        architectures=("Qwen2MoeForCausalLM",),
        bias_settings=(),
        weights=decoder_weights(qkv_bias=True, qk_norm=False, moe=QWEN2_MOE_EXPERTS),
        moe=QWEN2_MOE_EXPERTS,
    )
)
