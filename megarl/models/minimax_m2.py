"""MiniMax-M2 family (``MiniMaxM2ForCausalLM``: MiniMax-M2, M2.1): grouped-query attention with partial rotary
embeddings (``rotary_dim`` of ``head_dim``: Megatron's ``rotary_percent``) and q/k RMSNorms over all heads of the
projection (:mod:`megarl.models.attention`), a mixture of experts in every layer under Mixtral's names
(``block_sparse_moe``, experts ``w1`` gate, ``w3`` up, ``w2`` down) with a sigmoid router that picks the top-k by
score plus the MLP block's own ``e_score_correction_bias`` and renormalises the k weights. No shared expert, no
group-limited routing. The checkpoints' multi-token-prediction modules (``num_mtp_modules`` layers after the model's)
are skipped on load and named.

SGLang's ``MiniMaxM2ForCausalLM`` reads four config keys transformers does not, with defaults that would serve
another model (no q/k norms, no routing bias, full rotary); megarl refuses a config without the published values
(:attr:`~megarl.models.family.ModelFamily.engine_settings`)."""

from megarl.models.attention import QK_NORM_ALL_HEADS, AttentionSpec
from megarl.models.family import ModelFamily, register
from megarl.models.mla import rope_parameters
from megarl.models.moe import MoESpec
from megarl.models.weights import decoder_weights

MINIMAX_M2_EXPERTS = MoESpec(experts_key="num_local_experts", ffn_key="intermediate_size", block="block_sparse_moe",
                             expert_tensors=("w1", "w3", "w2"), score_function="sigmoid", expert_bias=True,
                             expert_bias_tensor="e_score_correction_bias")
MINIMAX_M2_ATTENTION = AttentionSpec(qk_norm=QK_NORM_ALL_HEADS)


def _rotary_dim(hf_config) -> int:
    """The rotary width transformers applies (``head_dim`` × ``partial_rotary_factor``, which it derives from
    ``rotary_dim``), which SGLang reads as ``rotary_dim``."""
    factor = float(rope_parameters(hf_config).get("partial_rotary_factor", 1.0))
    return int(int(hf_config.head_dim) * factor)


MINIMAX_M2 = register(
    ModelFamily(
        name="minimax_m2",
        architectures=("MiniMaxM2ForCausalLM",),
        bias_settings=(),
        weights=decoder_weights(qkv_bias=False, qk_norm=True, moe=MINIMAX_M2_EXPERTS,
                                qk_norm_all_heads=MINIMAX_M2_ATTENTION.qk_norm_all_heads),
        moe=MINIMAX_M2_EXPERTS,
        attention=MINIMAX_M2_ATTENTION,
        engine_settings=(
            ("use_qk_norm", True, "builds the attention without its q/k norms"),
            ("use_routing_bias", True, "routes without e_score_correction_bias"),
            ("scoring_func", "sigmoid", "scores the experts by it"),
            ("rotary_dim", _rotary_dim, "rotates that many dimensions of each head (default: all)"),
        ),
        extra_layers_key="num_mtp_modules",
    )
)
