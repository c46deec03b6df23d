"""Declarative weight rules: how each HF tensor maps to a Megatron tensor.

A :class:`WeightRule` names one Megatron parameter (with ``{i}`` for the global layer
index), the HF tensor(s) it is made of, how they are fused, and how tensor parallelism
splits it. Loading, exporting, checkpoint conversion and weight sync all read these rules;
``megarl.convert`` implements the transforms.
"""

from __future__ import annotations

import dataclasses
import enum


class Split(enum.Enum):
    """How a tensor is divided over tensor-parallel ranks."""

    REPLICATED = "replicated"
    """Every rank holds the whole tensor (norms)."""
    COLUMN = "column"
    """Output rows split into contiguous blocks (dim 0)."""
    ROW = "row"
    """Input columns split into contiguous blocks (dim 1)."""
    VOCAB = "vocab"
    """Vocabulary rows split after padding to the padded vocabulary (dim 0)."""


class Fuse(enum.Enum):
    """How several HF tensors make one Megatron tensor."""

    NONE = "none"
    QKV = "qkv"
    """q, k, v interleaved per query group: [q heads of group g, k_g, v_g] for each g."""
    GATE_UP = "gate_up"
    """SwiGLU gate and up projections; each TP shard holds its gate slice, then its up slice."""


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    """Name in the local layer spec; ``{i}`` is the global layer index."""
    hf: tuple[str, ...]
    """HF tensor names, in fusion order; ``{i}`` is the layer index."""
    split: Split
    fuse: Fuse = Fuse.NONE
    te_megatron: str | None = None
    """Name under the TransformerEngine spec, where norms fuse into the next linear layer."""
    untied_only: bool = False
    """Present only when input and output embeddings are not tied."""

    @property
    def per_layer(self) -> bool:
        """True for tensors repeated in every transformer layer."""
        return "{i}" in self.megatron

    def megatron_name(self, layer: int | None = None, *, te: bool = False) -> str:
        """The Megatron name for ``layer`` (global index), in the local or TE spec."""
        name = self.te_megatron if te and self.te_megatron else self.megatron
        return name.format(i=layer) if self.per_layer else name

    def hf_names(self, layer: int | None = None) -> tuple[str, ...]:
        """The HF names for ``layer``."""
        return tuple(n.format(i=layer) for n in self.hf) if self.per_layer else self.hf


def decoder_weights(*, qkv_bias: bool, qk_norm: bool) -> tuple[WeightRule, ...]:
    """Rules for Llama-style HF decoders (``model.layers.{i}.self_attn.q_proj`` naming)."""
    layer, attn, mlp = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    m_layer, m_attn, m_mlp = "decoder.layers.{i}.", "decoder.layers.{i}.self_attention.", "decoder.layers.{i}.mlp."
    rules = [
        WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
        WeightRule(
            m_layer + "input_layernorm.weight", (layer + "input_layernorm.weight",), Split.REPLICATED,
            te_megatron=m_attn + "linear_qkv.layer_norm_weight",
        ),
        WeightRule(
            m_attn + "linear_qkv.weight",
            tuple(attn + f"{p}_proj.weight" for p in "qkv"), Split.COLUMN, Fuse.QKV,
        ),
    ]
    if qkv_bias:
        rules.append(
            WeightRule(m_attn + "linear_qkv.bias", tuple(attn + f"{p}_proj.bias" for p in "qkv"), Split.COLUMN, Fuse.QKV)
        )
    if qk_norm:
        rules += [
            WeightRule(m_attn + "q_layernorm.weight", (attn + "q_norm.weight",), Split.REPLICATED),
            WeightRule(m_attn + "k_layernorm.weight", (attn + "k_norm.weight",), Split.REPLICATED),
        ]
    rules += [
        WeightRule(m_attn + "linear_proj.weight", (attn + "o_proj.weight",), Split.ROW),
        WeightRule(
            m_layer + "pre_mlp_layernorm.weight", (layer + "post_attention_layernorm.weight",), Split.REPLICATED,
            te_megatron=m_mlp + "linear_fc1.layer_norm_weight",
        ),
        WeightRule(
            m_mlp + "linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), Split.COLUMN, Fuse.GATE_UP
        ),
        WeightRule(m_mlp + "linear_fc2.weight", (mlp + "down_proj.weight",), Split.ROW),
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
        WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB, untied_only=True),
    ]
    return tuple(rules)
