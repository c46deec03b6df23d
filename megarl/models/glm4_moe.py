"""GLM-4.5 / GLM-4.6 MoE family (``Glm4MoeForCausalLM``): attention with q/k/v biases where ``attention_bias`` (the
published checkpoints), per-head q/k norms where
``use_qk_norm`` (GLM-4.5 and 4.6; not GLM-4.5-Air) and partial rotary embeddings (``partial_rotary_factor``:
Megatron's ``rotary_percent``), the first ``first_k_dense_replace`` layers dense, then
mixture-of-experts MLPs with a sigmoid router (top-k by score plus the aux-loss-free ``e_score_correction_bias``,
weights renormalised and scaled by ``routed_scaling_factor``, group-limited when ``n_group > 1``) and
``n_shared_experts`` shared experts every token goes through. The checkpoints' multi-token-prediction layer
(``model.layers.<num_hidden_layers>.*``) is skipped on load and named."""

from megarl.models.family import ModelFamily, register
from megarl.models.moe import MoESpec
from megarl.models.weights import decoder_weights

GLM4_MOE_EXPERTS = MoESpec(experts_key="n_routed_experts", ffn_key="moe_intermediate_size",
                           norm_topk_key="norm_topk_prob", first_dense_key="first_k_dense_replace",
                           shared_experts_count_key="n_shared_experts", shared_expert_module="shared_experts",
                           score_function="sigmoid", expert_bias=True, scaling_key="routed_scaling_factor",
                           group_keys=("n_group", "topk_group"))

GLM4_MOE = register(
    ModelFamily(
        name="glm4_moe",
        architectures=("Glm4MoeForCausalLM",),
        bias_settings=(),
        # q/k/v biases under attention_bias (the published checkpoints' true; transformers' default false)
        weights=decoder_weights(qkv_bias="attention_bias", qk_norm="use_qk_norm", moe=GLM4_MOE_EXPERTS),
        moe=GLM4_MOE_EXPERTS,
        extra_layers_key="num_nextn_predict_layers",  # GLM-4.5's checkpoints hold an MTP layer after the model's
    )
)
