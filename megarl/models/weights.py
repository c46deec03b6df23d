"""Declarative weight rules: how each HF tensor maps to a Megatron tensor.

A :class:`WeightRule` names one Megatron parameter (with ``{i}`` for the global layer
index and, for experts, ``{e}`` for the global expert index), the HF tensor(s) it is made of,
how they are fused, and how tensor parallelism splits it (expert tensors: expert-tensor
parallelism). A rule applies to every layer, or only to dense or only to sparse (MoE) layers.
:class:`RuleAt` is one rule at one layer and expert: what the family's
:meth:`~megarl.models.family.ModelFamily.weight_instances` lists in HF order. Loading,
exporting, checkpoint conversion and weight sync all read these; ``megarl.convert``
implements the transforms.
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
    GATED_QKV = "gated_qkv"
    """Attention with an output gate (Qwen3.5): HF's ``q_proj`` holds per head its query then its gate; Megatron's
    ``linear_qkv`` per query group its queries, their gates, k, v (``attention_output_gate``)."""


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
    """Name under the TransformerEngine spec, where norms fuse into the next linear layer and a grouped-GEMM expert
    is ``weight{e}`` (:func:`megarl.convert.param_map.local_parameters` gives ``{e}`` the global expert index)."""
    untied_only: bool = False
    """Present only when input and output embeddings are not tied."""
    layers: str = "all"
    """The layers that have this tensor: ``all``, ``dense`` (a dense MLP) or ``moe`` (a mixture of experts)."""
    first_stage: bool = False
    """A tensor of the first pipeline stage besides the embedding (a vision tower's)."""
    when: str | None = None
    """An HF config flag this tensor exists under (GLM-4.5's ``use_qk_norm``: its q/k norms); None: always."""
    linear: bool = False
    """A replicated linear layer's weight (MLA's down projections): quantized by FP8 rollout like the split ones
    (:attr:`block_fp8`), as in DeepSeek-V3's FP8 checkpoints, where SGLang's loader expects them in FP8."""
    keep_fp32: bool = False
    """Kept in fp32 whatever the model's dtype, and exported and synced in fp32 (a router's expert bias: Megatron
    keeps the buffer in fp32, the hub's checkpoints and SGLang hold it in fp32; bf16's 8 bits would move the
    top-k choices it decides and swallow its updates)."""
    unquantized: bool = False
    """Never quantized by FP8 rollout, though split like a linear layer's weight: a norm's weight split by head
    (MiniMax-M2's q/k norms over all heads, :mod:`megarl.models.attention`), a convolution's (Gated DeltaNet's)."""
    rows: tuple["Rows | None", ...] = ()
    """Per HF tensor (empty: none): its rows as pieces that tensor parallelism splits each by itself
    (:class:`Rows`); a rank's slice is its share of every piece, piece after piece."""
    checkpoint_parts: tuple[tuple[str, str], ...] = ()
    """``(key suffix, named row count)``: Megatron's distributed checkpoint saves the tensor as these parts (Gated
    DeltaNet's ``in_proj.weight.query``, ``.key``, ...), each the whole model's rows of one piece (empty: whole)."""
    attention: str = "all"
    """The layers that have this tensor by their attention: ``all``, ``full_attention`` or ``linear_attention``
    (a hybrid model's Gated DeltaNet layers: :mod:`megarl.models.linear_attention`)."""
    coload: str | None = None
    """The tensors of a layer's rules with the same key reach SGLang in one weight-update request, or not at all:
    its loader fuses them into one parameter only when a single ``load_weights`` call brings them all (DeepSeek's
    ``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj_with_mqa``; a lone one is dropped). The weight
    sync never splits such a group across buckets (:func:`megarl.convert.param_map.buckets`); megarl's CPU engine
    drops a lone member as SGLang does (:meth:`ModelFamily.coload_groups`)."""

    @property
    def on_first_stage(self) -> bool:
        """Whether the first pipeline stage holds this (non-layer) tensor; else the last one does."""
        return self.first_stage or self.megatron.startswith("embedding.")

    @property
    def per_layer(self) -> bool:
        """True for tensors repeated in every transformer layer."""
        return "{i}" in self.megatron

    @property
    def block_fp8(self) -> bool:
        """True for the linear layers' weights (column- and row-parallel ``weight`` tensors: attention and MLP
        projections, experts), which FP8 rollout quantizes (:mod:`megarl.models.fp8`); embeddings, norms, routers,
        biases and the output layer stay in the model's dtype. A replicated linear layer (:attr:`linear`) too."""
        return ((self.split in (Split.COLUMN, Split.ROW) or self.linear) and self.megatron.endswith(".weight")
                and not self.unquantized)

    @property
    def per_expert(self) -> bool:
        """True for tensors repeated for every expert of a sparse layer (split by expert-tensor parallelism)."""
        return "{e}" in self.megatron

    def applies_to(self, sparse: bool, attention: str = "full_attention") -> bool:
        """Whether a layer whose MLP is sparse (``sparse``) or dense, with ``attention`` (full or linear), has this
        tensor."""
        return ((self.layers == "all" or self.layers == ("moe" if sparse else "dense"))
                and self.attention in ("all", attention))

    def megatron_name(self, layer: int | None = None, *, expert: int | None = None, te: bool = False) -> str:
        """The Megatron name for ``layer`` and ``expert`` (global indices), in the local or TE spec."""
        name = self.te_megatron if te and self.te_megatron else self.megatron
        return name.format(i=layer, e=expert) if self.per_layer else name

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> tuple[str, ...]:
        """The HF names for ``layer`` and ``expert``."""
        return tuple(n.format(i=layer, e=expert) for n in self.hf) if self.per_layer else self.hf


@dataclasses.dataclass(frozen=True)
class Rows:
    """An HF tensor whose rows are pieces that tensor parallelism splits each by itself: ``pieces`` name their row
    counts (sizes the family gives by name, :attr:`megarl.convert.layout.ModelSizes.named`); with ``groups`` (a
    named count) the tensor repeats the pieces once per group (Qwen3-Next's projections, grouped per key head), and a
    rank holds its share of the groups. A rank's slice is, piece after piece, its rows of that piece (of each of its
    groups in order): what Megatron's fused layers hold (Gated DeltaNet's ``in_proj``: its queries, keys, values...)."""

    pieces: tuple[str, ...]
    groups: str | None = None


@dataclasses.dataclass(frozen=True)
class RuleAt:
    """One rule at one layer (None: not a layer tensor) and expert (None: not an expert tensor)."""

    rule: WeightRule
    layer: int | None = None
    expert: int | None = None

    @property
    def megatron_name(self) -> str:
        return self.rule.megatron_name(self.layer, expert=self.expert)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.rule.hf_names(self.layer, self.expert)


def coload_key(at) -> tuple | None:
    """The co-load group a rule placed at a layer and expert belongs to (``at``: a :class:`RuleAt` or anything with
    ``rule``, ``layer`` and ``expert``, such as the weight sync's units); None: none
    (:attr:`WeightRule.coload`)."""
    return None if at.rule.coload is None else (at.layer, at.expert, at.rule.coload)


def decoder_weights(*, qkv_bias: bool | str, qk_norm: bool | str, moe=None, prefix: str = "model.",
                    attention: list[WeightRule] | None = None, qk_norm_all_heads: bool = False,
                    output_gate: bool = False, linear_attention: list[WeightRule] | None = None
                    ) -> tuple[WeightRule, ...]:
    """Rules for Llama-style HF decoders (``model.layers.{i}.self_attn.q_proj`` naming; ``prefix``: where the
    checkpoint keeps the decoder, e.g. ``model.language_model.`` in a vision-language model's); with ``moe`` (a
    :class:`~megarl.models.moe.MoESpec`) the sparse layers' router and experts too (Megatron's SequentialMLP names;
    TransformerEngine's grouped GEMM names ``linear_fc1.weight<e>``); ``attention``: the attention's rules instead of
    the q/k/v and output projections' (multi-latent attention: :func:`megarl.models.mla.mla_weights`);
    ``qk_norm_all_heads``: the q/k norms normalise all heads at once, their weights split by head
    (:mod:`megarl.models.attention`); ``output_gate``: ``q_proj`` also makes the attention's output gate
    (:attr:`Fuse.GATED_QKV`); ``linear_attention``: the Gated DeltaNet mixer's rules of a hybrid model's
    linear-attention layers (:meth:`megarl.models.linear_attention.LinearAttentionSpec.weight_rules`), the attention
    rules then those of its full-attention layers."""
    layer, attn, mlp = f"{prefix}layers.{{i}}.", f"{prefix}layers.{{i}}.self_attn.", f"{prefix}layers.{{i}}.mlp."
    m_layer, m_attn, m_mlp = "decoder.layers.{i}.", "decoder.layers.{i}.self_attention.", "decoder.layers.{i}.mlp."
    full = "all" if linear_attention is None else "full_attention"
    rules = [
        WeightRule("embedding.word_embeddings.weight", (f"{prefix}embed_tokens.weight",), Split.VOCAB),
        WeightRule(  # TE fuses it into linear_qkv; MLA's down projections are plain TELinear, its TENorm stays
            m_layer + "input_layernorm.weight", (layer + "input_layernorm.weight",), Split.REPLICATED,
            te_megatron=m_attn + "linear_qkv.layer_norm_weight" if attention is None else None, attention=full,
        ),
    ]
    full_rules = attention if attention is not None else _qkv_attention(
        attn, m_attn, qkv_bias=qkv_bias, qk_norm=qk_norm, all_heads=qk_norm_all_heads, output_gate=output_gate)
    rules += [dataclasses.replace(rule, attention=full) for rule in full_rules]
    if linear_attention is not None:  # TE fuses the input norm into the Gated DeltaNet's in_proj
        rules.append(WeightRule(m_layer + "input_layernorm.weight", (layer + "input_layernorm.weight",),
                                Split.REPLICATED, te_megatron=m_attn + "in_proj.layer_norm_weight",
                                attention="linear_attention"))
        rules += linear_attention
    dense = "dense" if moe is not None else "all"
    rules += [
        WeightRule(
            m_layer + "pre_mlp_layernorm.weight", (layer + "post_attention_layernorm.weight",), Split.REPLICATED,
            te_megatron=m_mlp + "linear_fc1.layer_norm_weight", layers=dense,
        ),
        WeightRule(
            m_mlp + "linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), Split.COLUMN, Fuse.GATE_UP,
            layers=dense,
        ),
        WeightRule(m_mlp + "linear_fc2.weight", (mlp + "down_proj.weight",), Split.ROW, layers=dense),
    ]
    if moe is not None:
        block = f"{prefix}layers.{{i}}.{moe.block}."
        expert = block + "experts.{e}."
        gate, up, down = (expert + f"{name}.weight" for name in moe.expert_tensors)
        m_expert = m_mlp + "experts.local_experts.{e}."
        rules += [
            # TransformerEngine's MoE layer keeps its own pre-MLP norm (nothing to fuse it into).
            WeightRule(m_layer + "pre_mlp_layernorm.weight", (layer + "post_attention_layernorm.weight",),
                       Split.REPLICATED, layers="moe"),
            WeightRule(m_mlp + "router.weight", (block + "gate.weight",), Split.REPLICATED, layers="moe"),
            WeightRule(m_expert + "linear_fc1.weight", (gate, up), Split.COLUMN, Fuse.GATE_UP,
                       te_megatron=m_mlp + "experts.linear_fc1.weight{e}", layers="moe"),
            WeightRule(m_expert + "linear_fc2.weight", (down,), Split.ROW,
                       te_megatron=m_mlp + "experts.linear_fc2.weight{e}", layers="moe"),
        ]
        if moe.expert_bias:  # a buffer in both: not trained, routing's aux-loss-free balance
            rules.append(WeightRule(m_mlp + "router.expert_bias", (block + moe.expert_bias_tensor,),
                                    Split.REPLICATED, layers="moe", keep_fp32=True))
        if moe.shared_expert_key is not None or moe.shared_experts_count_key is not None:
            # Megatron's SharedExpertMLP, split by tensor parallelism
            shared, m_shared = f"{block}{moe.shared_expert_module}.", m_mlp + "shared_experts."
            rules += [
                WeightRule(m_shared + "linear_fc1.weight", (shared + "gate_proj.weight", shared + "up_proj.weight"),
                           Split.COLUMN, Fuse.GATE_UP, layers="moe"),
                WeightRule(m_shared + "linear_fc2.weight", (shared + "down_proj.weight",), Split.ROW, layers="moe"),
            ]
            if moe.shared_expert_gate:
                rules.append(WeightRule(m_shared + "gate_weight", (block + "shared_expert_gate.weight",),
                                        Split.REPLICATED, layers="moe"))
    rules += [
        WeightRule("decoder.final_layernorm.weight", (f"{prefix}norm.weight",), Split.REPLICATED),
        WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB, untied_only=True),
    ]
    return tuple(rules)


def _qkv_attention(attn: str, m_attn: str, *, qkv_bias: bool | str, qk_norm: bool | str,
                   all_heads: bool = False, output_gate: bool = False) -> list[WeightRule]:
    """Llama-style attention: q/k/v fused per query group, optional biases and per-head norms, the output (a string
    for ``qkv_bias`` or ``qk_norm``: the HF config flag they exist under)."""
    rules = [WeightRule(m_attn + "linear_qkv.weight", tuple(attn + f"{p}_proj.weight" for p in "qkv"), Split.COLUMN,
                        Fuse.GATED_QKV if output_gate else Fuse.QKV)]
    if qkv_bias:
        rules.append(
            WeightRule(m_attn + "linear_qkv.bias", tuple(attn + f"{p}_proj.bias" for p in "qkv"), Split.COLUMN,
                       Fuse.QKV, when=qkv_bias if isinstance(qkv_bias, str) else None)
        )
    if qk_norm:  # a string: the config flag they exist under
        when, split = qk_norm if isinstance(qk_norm, str) else None, Split.COLUMN if all_heads else Split.REPLICATED
        rules += [
            WeightRule(m_attn + "q_layernorm.weight", (attn + "q_norm.weight",), split, when=when, unquantized=all_heads),
            WeightRule(m_attn + "k_layernorm.weight", (attn + "k_norm.weight",), split, when=when, unquantized=all_heads),
        ]
    rules.append(WeightRule(m_attn + "linear_proj.weight", (attn + "o_proj.weight",), Split.ROW))
    return rules
