"""Qwen3-Next family (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B): Qwen3.5's hybrid (Gated DeltaNet linear
attention in three of four layers, gated full attention in the fourth, zero-centred norms, rotary on a quarter of each
head) whose checkpoints fuse the linear attention's input projections per key head (``in_proj_qkvz``: each key
head's query, key, values and gates; ``in_proj_ba``: its betas and alphas; :mod:`megarl.models.linear_attention`),
and a mixture of experts (512 of which 10 per token, softmax, ``norm_topk_prob``) beside a gated shared expert, with
Qwen3-MoE's ``decoder_sparse_step`` and ``mlp_only_layers``."""

from megarl.models.family import ModelFamily, register
from megarl.models.linear_attention import LinearAttentionSpec
from megarl.models.moe import MoESpec
from megarl.models.qwen3_5 import QWEN3_5_ATTENTION
from megarl.models.weights import decoder_weights

QWEN3_NEXT_LINEAR = LinearAttentionSpec(grouped=True)
QWEN3_NEXT_EXPERTS = MoESpec(experts_key="num_experts", ffn_key="moe_intermediate_size", norm_topk_key="norm_topk_prob",
                             sparse_step_key="decoder_sparse_step", dense_layers_key="mlp_only_layers",
                             shared_expert_key="shared_expert_intermediate_size", shared_expert_gate=True)

QWEN3_NEXT = register(
    ModelFamily(
        name="qwen3_next",
        architectures=("Qwen3NextForCausalLM",),
        bias_settings=("attention_bias",),
        weights=decoder_weights(qkv_bias=False, qk_norm=True, output_gate=True, moe=QWEN3_NEXT_EXPERTS,
                                linear_attention=QWEN3_NEXT_LINEAR.weight_rules()),
        moe=QWEN3_NEXT_EXPERTS,
        attention=QWEN3_5_ATTENTION,
        linear_attention=QWEN3_NEXT_LINEAR,
        zero_centered_norms=True,
        extra_prefix="mtp.",  # the checkpoints' multi-token-prediction module
    )
)
