"""Qwen2.5-VL family: Qwen2's language model (q/k/v biases) with multimodal RoPE, and Qwen2.5-VL's vision tower
(windowed attention blocks, a 2×2 patch merger) in front of it (:mod:`megarl.models.vision`)."""

from megarl.models.family import ModelFamily, register
from megarl.models.vision import VisionSpec
from megarl.models.weights import decoder_weights

QWEN2_5_VL = register(
    ModelFamily(
        name="qwen2_5_vl",
        architectures=("Qwen2_5_VLForConditionalGeneration",),
        bias_settings=(),
        weights=decoder_weights(qkv_bias=True, qk_norm=False),
        vision=VisionSpec(
            tower="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel"),
    )
)
