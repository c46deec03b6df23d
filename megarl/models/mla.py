"""Multi-latent attention (DeepSeek-V3, Kimi-K2): the queries and the keys and values through low-rank projections
with an RMSNorm each, a decoupled rotary part of every query head and one rotary key shared by all heads.

One :class:`MLASpec` per family maps the HF config onto Megatron's ``MLATransformerConfig`` and the HF tensors onto
Megatron's ``MLASelfAttention`` (local layer spec) by name:

===========================================  ==========================================  =========================
HF ``model.layers.{i}.self_attn.``            Megatron ``decoder.layers.{i}.self_attention.``   tensor parallelism
===========================================  ==========================================  =========================
``q_a_proj.weight`` [q_lora, H]               ``linear_q_down_proj.weight``               replicated
``q_a_layernorm.weight`` [q_lora]             ``q_layernorm.weight``                      replicated
``q_b_proj.weight`` [n·(nope+rope), q_lora]   ``linear_q_up_proj.weight``                 by head
``kv_a_proj_with_mqa.weight`` [kv_lora+rope, H]  ``linear_kv_down_proj.weight``           replicated
``kv_a_layernorm.weight`` [kv_lora]           ``kv_layernorm.weight``                     replicated
``kv_b_proj.weight`` [n·(nope+v), kv_lora]    ``linear_kv_up_proj.weight``                by head
``o_proj.weight`` [H, n·v]                    ``linear_proj.weight``                      input columns
===========================================  ==========================================  =========================

Rows keep their order: per head ``[nope ‖ rope]`` queries and ``[nope key ‖ value]``, and the down projection of
the keys ``[latent ‖ rotary key]`` on both sides. With ``rope_interleave`` (both models' setting) HF's rotary
de-interleaves the rotary dimensions before rotating them by halves, which Megatron's MLA rotary does too, so the
rotary rows need no permutation. The softmax scale is ``mscale² / sqrt(nope + rope)`` on both sides, YaRN's
``mscale`` from ``mscale_all_dim``.

On CPU an MLA family builds Megatron's local layer spec (:mod:`megarl.parallel.megatron_patches` point 14: its down
projections replicated over TP, as TransformerEngine's spec has them); on a GPU with TransformerEngine, TE's MLA spec
(``get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)``: fused attention, grouped GEMM), which
fuses the q and kv norms into the up projections (``linear_q_up_proj.layer_norm_weight``,
``linear_kv_up_proj.layer_norm_weight``: the rules' ``te_megatron`` names) and keeps the input norm its own
(``input_layernorm.weight``, a ``TENorm``: the down projections are plain ``TELinear``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megarl.models.weights import Split, WeightRule


def rope_parameters(hf_config) -> dict[str, Any]:
    """The HF config's RoPE settings (``rope_parameters``; older configs' ``rope_scaling`` and ``rope_theta``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention as a family's HF config names it (DeepSeek-V3's keys)."""

    q_lora_key: str = "q_lora_rank"
    kv_lora_key: str = "kv_lora_rank"
    nope_key: str = "qk_nope_head_dim"
    rope_key: str = "qk_rope_head_dim"
    v_key: str = "v_head_dim"

    def dims(self, hf_config) -> dict[str, int]:
        """``q_lora``, ``kv_lora``, ``nope``, ``rope``, ``v`` (per head) from the HF config."""
        keys = {"q_lora": self.q_lora_key, "kv_lora": self.kv_lora_key, "nope": self.nope_key,
                "rope": self.rope_key, "v": self.v_key}
        return {name: int(getattr(hf_config, key)) for name, key in keys.items()}

    def check(self, hf_config) -> None:
        """Refuse what megarl does not map, naming the HF config key."""
        if getattr(hf_config, self.q_lora_key, None) is None:
            raise ValueError(f"{self.q_lora_key}=null in the HF config (a direct query projection, as in "
                             "DeepSeek-V2-Lite) is not mapped; megarl maps low-rank queries (DeepSeek-V3, Kimi-K2)")
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("attention_bias=true in the HF config adds biases to the latent projections, which "
                             "Megatron's MLA cannot hold; this checkpoint is not supported")
        if not getattr(hf_config, "rope_interleave", True):
            raise ValueError("rope_interleave=false in the HF config: megarl maps DeepSeek-V3's interleaved rotary "
                             "layout (the checkpoints of DeepSeek-V3 and Kimi-K2); this checkpoint is not supported")
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_parameters.rope_type={rope_type!r} in the HF config: multi-latent attention "
                             "maps default and yarn")
        if rope_type == "yarn":
            if params.get("attention_factor") is not None:
                raise ValueError("rope_parameters.attention_factor in the HF config: Megatron derives it from mscale "
                                 "and mscale_all_dim; remove it or leave it to them")
            if params.get("truncate") is False:
                raise ValueError("rope_parameters.truncate=false in the HF config: Megatron's YaRN rounds its "
                                 "correction range; this checkpoint is not supported")
            if float(params.get("mscale") or 1.0) != 1.0 and not params.get("mscale_all_dim"):
                raise ValueError("rope_parameters.mscale without mscale_all_dim in the HF config: transformers then "
                                 "ignores mscale and Megatron does not; this checkpoint is not supported")

    def config_kwargs(self, hf_config) -> dict[str, Any]:
        """``MLATransformerConfig`` fields for ``hf_config`` (besides the model's common ones)."""
        d = self.dims(hf_config)
        params = rope_parameters(hf_config)
        yarn = params["rope_type"] == "yarn"
        return dict(
            num_query_groups=int(hf_config.num_attention_heads),  # every head its own keys and values
            multi_latent_attention=True, q_lora_rank=d["q_lora"], kv_lora_rank=d["kv_lora"],
            qk_head_dim=d["nope"], qk_pos_emb_head_dim=d["rope"], v_head_dim=d["v"],
            kv_channels=d["v"],  # the core attention's output width per head (HF's head_dim is the rotary width)
            qk_layernorm=True, rotary_interleaved=False, apply_rope_fusion=False, rotary_percent=1.0,
            rope_type="yarn" if yarn else "rope", rotary_base=float(params.get("rope_theta", 10000.0)),
            rotary_scaling_factor=float(params.get("factor", 1.0)) if yarn else 1.0,
            original_max_position_embeddings=int(params.get("original_max_position_embeddings") or
                                                 getattr(hf_config, "max_position_embeddings", 4096)),
            beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 1.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0) if yarn else 0.0,
        )

    def hub_shapes(self, hf_config, layer: int) -> dict[str, tuple[int, ...]]:
        """Layer ``layer``'s attention tensors as the checkpoint holds them, by HF name."""
        d, hidden = self.dims(hf_config), int(hf_config.hidden_size)
        heads = int(hf_config.num_attention_heads)
        attn = f"model.layers.{layer}.self_attn."
        return {attn + "q_a_proj.weight": (d["q_lora"], hidden), attn + "q_a_layernorm.weight": (d["q_lora"],),
                attn + "q_b_proj.weight": (heads * (d["nope"] + d["rope"]), d["q_lora"]),
                attn + "kv_a_proj_with_mqa.weight": (d["kv_lora"] + d["rope"], hidden),
                attn + "kv_a_layernorm.weight": (d["kv_lora"],),
                attn + "kv_b_proj.weight": (heads * (d["nope"] + d["v"]), d["kv_lora"]),
                attn + "o_proj.weight": (hidden, heads * d["v"])}


FUSED_A_PROJ = "fused_qkv_a_proj_with_mqa"
"""The co-load key of a layer's two down projections: SGLang's DeepSeek loader fuses ``q_a_proj`` and
``kv_a_proj_with_mqa`` (their ``weight_scale_inv`` too) into ``fused_qkv_a_proj_with_mqa`` only when one request brings
both (:attr:`megarl.models.weights.WeightRule.coload`)."""


def mla_weights(prefix: str = "model.") -> list[WeightRule]:
    """The attention rules of an MLA layer (see the module docstring)."""
    attn, m_attn = f"{prefix}layers.{{i}}.self_attn.", "decoder.layers.{i}.self_attention."
    return [
        WeightRule(m_attn + "linear_q_down_proj.weight", (attn + "q_a_proj.weight",), Split.REPLICATED,
                   linear=True, coload=FUSED_A_PROJ),
        WeightRule(m_attn + "q_layernorm.weight", (attn + "q_a_layernorm.weight",), Split.REPLICATED,
                   te_megatron=m_attn + "linear_q_up_proj.layer_norm_weight"),
        WeightRule(m_attn + "linear_q_up_proj.weight", (attn + "q_b_proj.weight",), Split.COLUMN),
        WeightRule(m_attn + "linear_kv_down_proj.weight", (attn + "kv_a_proj_with_mqa.weight",), Split.REPLICATED,
                   linear=True, coload=FUSED_A_PROJ),
        WeightRule(m_attn + "kv_layernorm.weight", (attn + "kv_a_layernorm.weight",), Split.REPLICATED,
                   te_megatron=m_attn + "linear_kv_up_proj.layer_norm_weight"),
        WeightRule(m_attn + "linear_kv_up_proj.weight", (attn + "kv_b_proj.weight",), Split.COLUMN),
        WeightRule(m_attn + "linear_proj.weight", (attn + "o_proj.weight",), Split.ROW),
    ]
