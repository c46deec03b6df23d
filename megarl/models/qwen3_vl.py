"""Qwen3-VL family: Qwen3's language model (per-head q/k RMSNorm, explicit head_dim, no biases) with interleaved
multimodal RoPE, and Qwen3-VL's vision tower (learned position embeddings, a 2×2 patch merger, DeepStack: features
of inner vision blocks added to the first language-model layers' image tokens) in front of it
(:mod:`megarl.models.vision`). Its checkpoints keep transformers' ``model.language_model.`` / ``model.visual.``
names."""

from megarl.models.family import ModelFamily, register
from megarl.models.vision import VisionSpec
from megarl.models.weights import decoder_weights

QWEN3_VL = register(
    ModelFamily(
        name="qwen3_vl",
        architectures=("Qwen3VLForConditionalGeneration",),
        bias_settings=("attention_bias",),
        weights=decoder_weights(qkv_bias=False, qk_norm=True, prefix="model.language_model."),
        vision=VisionSpec(
            tower="transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
            hf_prefix="model.visual.", checkpoint_renames=(), mrope="interleaved", deepstack=True),
    )
)
