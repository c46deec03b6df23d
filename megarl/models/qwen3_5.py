"""Qwen3.5 dense and MoE families (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``: their text models, HF
``model_type`` ``qwen3_5_text`` / ``qwen3_5_moe_text``): a hybrid of Gated DeltaNet linear attention in most layers
(``layer_types``: :mod:`megarl.models.linear_attention`) and gated full attention in the others (Qwen3's per-head
q/k norms, ``q_proj`` making each head's query and output gate: :class:`~megarl.models.attention.AttentionSpec`),
rotary embeddings on a quarter of each head (``partial_rotary_factor``), zero-centred RMSNorms (``1 + weight``:
Megatron's ``layernorm_zero_centered_gamma``; the Gated DeltaNet's output norm a plain one). The MoE model routes
by softmax over its experts, renormalising the top-k, beside a shared expert with a sigmoid gate (Qwen2-MoE's
names), in every layer."""

from megarl.models.attention import AttentionSpec
from megarl.models.family import ModelFamily, register
from megarl.models.linear_attention import LinearAttentionSpec
from megarl.models.moe import MoESpec
from megarl.models.weights import decoder_weights

QWEN3_5_ATTENTION = AttentionSpec(output_gate=True)
QWEN3_5_LINEAR = LinearAttentionSpec()
QWEN3_5_MOE_EXPERTS = MoESpec(experts_key="num_experts", ffn_key="moe_intermediate_size",
                              shared_expert_key="shared_expert_intermediate_size", shared_expert_gate=True)

QWEN3_5 = register(
    ModelFamily(
        name="qwen3_5",
        architectures=("Qwen3_5ForCausalLM",),
        bias_settings=("attention_bias",),
        weights=decoder_weights(qkv_bias=False, qk_norm=True, output_gate=True,
                                linear_attention=QWEN3_5_LINEAR.weight_rules()),
        attention=QWEN3_5_ATTENTION,
        linear_attention=QWEN3_5_LINEAR,
        zero_centered_norms=True,
        extra_prefix="mtp.",  # the checkpoints' multi-token-prediction module
    )
)

QWEN3_5_MOE = register(
    ModelFamily(
        name="qwen3_5_moe",
        architectures=("Qwen3_5MoeForCausalLM",),
        bias_settings=("attention_bias",),
        weights=decoder_weights(qkv_bias=False, qk_norm=True, output_gate=True, moe=QWEN3_5_MOE_EXPERTS,
                                linear_attention=QWEN3_5_LINEAR.weight_rules()),
        moe=QWEN3_5_MOE_EXPERTS,
        attention=QWEN3_5_ATTENTION,
        linear_attention=QWEN3_5_LINEAR,
        zero_centered_norms=True,
        extra_prefix="mtp.",  # the checkpoints' multi-token-prediction module
    )
)
