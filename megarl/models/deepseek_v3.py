"""DeepSeek-V3 family (``DeepseekV3ForCausalLM``: DeepSeek-V3/V3.1/R1; Kimi-K2's checkpoints name this architecture
too, with ``model_type: kimi_k2``, which transformers does not know and megarl reads as DeepSeek-V3's config; their
own config code, the same fields, with ``trust_remote_code``): multi-latent attention (:mod:`megarl.models.mla`: low-rank queries and keys/values with their norms,
a decoupled rotary part, YaRN), the first ``first_k_dense_replace`` layers dense, then mixture-of-experts MLPs with a
sigmoid router (top-k by score plus the aux-loss-free ``e_score_correction_bias``, weights renormalised and scaled by
``routed_scaling_factor``, group-limited by ``n_group`` / ``topk_group``) and ``n_shared_experts`` shared experts
every token goes through. The checkpoints' multi-token-prediction layer (``model.layers.<num_hidden_layers>.*``)
is not part of the model RL trains: the loader skips it and names it."""

from megarl.models.family import ModelFamily, register
from megarl.models.glm4_moe import GLM4_MOE_EXPERTS
from megarl.models.mla import MLASpec, mla_weights
from megarl.models.weights import decoder_weights

DEEPSEEK_V3_EXPERTS = GLM4_MOE_EXPERTS
"""DeepSeek-V3's experts and router under the same HF keys as GLM-4.5's (which took them from DeepSeek-V3)."""

DEEPSEEK_V3 = register(
    ModelFamily(
        name="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM",),
        bias_settings=("attention_bias",),
        weights=decoder_weights(qkv_bias=False, qk_norm=False, moe=DEEPSEEK_V3_EXPERTS, attention=mla_weights()),
        moe=DEEPSEEK_V3_EXPERTS,
        mla=MLASpec(),
        extra_layers_key="num_nextn_predict_layers",
        config_aliases=(("kimi_k2", "deepseek_v3"),),
    )
)
