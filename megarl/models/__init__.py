"""Model families: HF config -> Megatron TransformerConfig, layer spec and GPTModel chunks."""

from megarl.models import (  # noqa: F401  (register the families)
    deepseek_v3,
    glm4_moe,
    llama,
    minimax_m2,
    mixtral,
    qwen2,
    qwen2_5_vl,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)
from megarl.models.build import build_gpt_model, build_model_chunks, layer_offset
from megarl.models.family import FAMILIES, ModelFamily, family_for

__all__ = ["FAMILIES", "ModelFamily", "build_gpt_model", "build_model_chunks", "family_for", "layer_offset"]
