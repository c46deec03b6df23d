"""Hybrid linear attention (Qwen3.5, Qwen3-Next): Gated DeltaNet layers among full-attention ones, as a sub-spec of
a family's entry (as :mod:`megarl.models.mla` is for multi-latent attention).

The HF config's ``layer_types`` says which layers are ``linear_attention`` (three of four in the published models).
Such a layer is Megatron-Core's ``GatedDeltaNet`` (:class:`PackedGatedDeltaNet` here, which adds packed sequences):
one input projection to the queries and keys (``linear_num_key_heads`` of ``linear_key_head_dim``), the values and
the output gate (``linear_num_value_heads`` of ``linear_value_head_dim``), and two per-value-head scalars (``beta``,
``alpha``); a causal depthwise convolution over q/k/v (``linear_conv_kernel_dim``), L2-normalised q/k, the chunked
gated delta rule with decay ``g = -exp(A_log) · softplus(alpha + dt_bias)``, an RMSNorm per value head (plain, not
zero-centred, whatever the model's other norms are) gated by ``silu(z)``, and the output projection.

==========================================  ==========================================  =======================
HF ``model.layers.{i}.linear_attn.``         Megatron ``decoder.layers.{i}.self_attention.``  tensor parallelism
==========================================  ==========================================  =======================
``in_proj_qkv`` [2·K + V, H]  (Qwen3.5)      ``in_proj.weight`` rows [q k v z b a]         each piece by head
``in_proj_z`` [V, H], ``in_proj_b`` /
``in_proj_a`` [Hv, H]
``in_proj_qkvz`` / ``in_proj_ba`` (Qwen3-Next: the same pieces grouped per key head)
``conv1d.weight`` [2·K + V, 1, k]            ``conv1d.weight``                           each piece by head
``dt_bias``, ``A_log`` [Hv]                  ``dt_bias``, ``A_log``                      by head
``norm.weight`` [dv]                         ``out_norm.weight``                         replicated
``out_proj.weight`` [H, V]                   ``out_proj.weight``                         input columns
==========================================  ==========================================  =======================

K = key heads × key head width, V = value heads × value head width, Hv value heads. A tensor-parallel rank holds
its heads of every piece, piece after piece (:class:`megarl.models.weights.Rows`): its queries, its keys, its values,
its gates, its betas, its alphas. The input norm is the layer's own (``input_layernorm``; TransformerEngine fuses it
into ``in_proj``).

What Megatron's layer cannot do is refused before a rank starts, naming the setting: context parallelism
(``parallel.cp``), a TP size that does not divide both head counts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from megarl.models.weights import Rows, Split, WeightRule

LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearAttentionSpec:
    """Gated DeltaNet layers of a family, as its HF config names them (Qwen3.5's keys)."""

    layer_types_key: str = "layer_types"
    grouped: bool = False
    """The checkpoint fuses the input projections per key head (Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``,
    each key head's q, k, v, z, then its b, a); else one tensor per piece group (Qwen3.5's ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``)."""

    def linear_layers(self, hf_config) -> tuple[bool, ...]:
        """Per layer: whether it is a Gated DeltaNet layer."""
        types = list(getattr(hf_config, self.layer_types_key))
        unknown = sorted(set(types) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"{self.layer_types_key} in the HF config holds {unknown}: megarl maps {LINEAR!r} and "
                             f"{FULL!r} layers")
        if len(types) != int(hf_config.num_hidden_layers):
            raise ValueError(f"{self.layer_types_key} in the HF config has {len(types)} entries for "
                             f"num_hidden_layers={hf_config.num_hidden_layers}")
        return tuple(t == LINEAR for t in types)

    def heads(self, hf_config) -> dict[str, int]:
        """Key heads, value heads and their widths, and the convolution's kernel."""
        return {"key_heads": int(hf_config.linear_num_key_heads), "value_heads": int(hf_config.linear_num_value_heads),
                "key_dim": int(hf_config.linear_key_head_dim), "value_dim": int(hf_config.linear_value_head_dim),
                "kernel": int(hf_config.linear_conv_kernel_dim)}

    def named_sizes(self, hf_config) -> dict[str, int]:
        """The row counts the weight rules' :class:`~megarl.models.weights.Rows` name: ``linear_k`` (all key heads'
        rows), ``linear_v`` (all value heads'), ``linear_heads`` (value heads), and per key head (``linear_groups``
        of them) ``linear_group_k``, ``linear_group_v``, ``linear_group_heads``."""
        h = self.heads(hf_config)
        per = h["value_heads"] // h["key_heads"]
        return {"linear_k": h["key_heads"] * h["key_dim"], "linear_v": h["value_heads"] * h["value_dim"],
                "linear_heads": h["value_heads"], "linear_groups": h["key_heads"], "linear_group_k": h["key_dim"],
                "linear_group_v": per * h["value_dim"], "linear_group_heads": per}

    def check(self, hf_config, dims) -> None:
        """Refuse the layouts Megatron's Gated DeltaNet cannot run, naming the setting."""
        h = self.heads(hf_config)
        if dims.cp > 1:
            raise ValueError(f"parallel.cp={dims.cp}: Megatron's Gated DeltaNet layers (this model's "
                             f"{self.layer_types_key} {LINEAR!r}) run without context parallelism; set cp=1")
        for key, count in (("linear_num_key_heads", h["key_heads"]), ("linear_num_value_heads", h["value_heads"])):
            if count % dims.tp:
                raise ValueError(f"parallel.tp={dims.tp} does not divide the model's {key}={count} (its Gated "
                                 f"DeltaNet heads): choose parallel.tp among its divisors")
        if h["value_heads"] % h["key_heads"]:
            raise ValueError(f"linear_num_value_heads={h['value_heads']} in the HF config is not a multiple of "
                             f"linear_num_key_heads={h['key_heads']}; Megatron's Gated DeltaNet needs it")

    def config_kwargs(self, hf_config) -> dict[str, Any]:
        """``TransformerConfig`` fields of the linear-attention layers."""
        h = self.heads(hf_config)
        return dict(experimental_attention_variant="gated_delta_net",
                    linear_attention_freq=[int(x) for x in self.linear_layers(hf_config)],
                    linear_conv_kernel_dim=h["kernel"], linear_key_head_dim=h["key_dim"],
                    linear_value_head_dim=h["value_dim"], linear_num_key_heads=h["key_heads"],
                    linear_num_value_heads=h["value_heads"])

    def weight_rules(self, prefix: str = "model.") -> list[WeightRule]:
        """The rules of a linear-attention layer's mixer (its input norm is the decoder's rule)."""
        attn, m_attn = f"{prefix}layers.{{i}}.linear_attn.", "decoder.layers.{i}.self_attention."
        if self.grouped:
            per_key_head = Rows(("linear_group_k", "linear_group_k", "linear_group_v", "linear_group_v"),
                                groups="linear_groups")
            in_proj = WeightRule(m_attn + "in_proj.weight", (attn + "in_proj_qkvz.weight", attn + "in_proj_ba.weight"),
                                 Split.COLUMN, rows=(per_key_head, Rows(("linear_group_heads", "linear_group_heads"),
                                                                        groups="linear_groups")),
                                 attention=LINEAR)
        else:
            in_proj = WeightRule(m_attn + "in_proj.weight", tuple(attn + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
                                 Split.COLUMN, rows=(Rows(("linear_k", "linear_k", "linear_v")), Rows(("linear_v",)),
                                                     Rows(("linear_heads",)), Rows(("linear_heads",))),
                                 attention=LINEAR)
        # Megatron's checkpoint splits both by piece (GatedDeltaNet.sharded_state_dict)
        qkv_parts = (("query", "linear_k"), ("key", "linear_k"), ("value", "linear_v"))
        in_proj = dataclasses.replace(in_proj, checkpoint_parts=qkv_parts + (("z", "linear_v"), ("beta", "linear_heads"),
                                                                             ("alpha", "linear_heads")))
        return [
            in_proj,
            WeightRule(m_attn + "conv1d.weight", (attn + "conv1d.weight",), Split.COLUMN,
                       rows=(Rows(("linear_k", "linear_k", "linear_v")),), attention=LINEAR, unquantized=True,
                       checkpoint_parts=qkv_parts),
            WeightRule(m_attn + "dt_bias", (attn + "dt_bias",), Split.COLUMN, attention=LINEAR),
            WeightRule(m_attn + "A_log", (attn + "A_log",), Split.COLUMN, attention=LINEAR),
            WeightRule(m_attn + "out_norm.weight", (attn + "norm.weight",), Split.REPLICATED, attention=LINEAR),
            WeightRule(m_attn + "out_proj.weight", (attn + "out_proj.weight",), Split.ROW, attention=LINEAR),
        ]

    def hub_shapes(self, hf_config, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """A linear-attention layer's mixer tensors as the checkpoint holds them, by HF name."""
        n = self.named_sizes(hf_config)
        h = self.heads(hf_config)
        attn = f"model.layers.{layer}.linear_attn."
        k, v, heads = n["linear_k"], n["linear_v"], n["linear_heads"]
        if self.grouped:
            projections = {"in_proj_qkvz.weight": (2 * k + 2 * v, hidden), "in_proj_ba.weight": (2 * heads, hidden)}
        else:
            projections = {"in_proj_qkv.weight": (2 * k + v, hidden), "in_proj_z.weight": (v, hidden),
                           "in_proj_b.weight": (heads, hidden), "in_proj_a.weight": (heads, hidden)}
        return {attn + name: shape for name, shape in {
            **projections, "conv1d.weight": (2 * k + v, 1, h["kernel"]), "dt_bias": (heads,), "A_log": (heads,),
            "norm.weight": (h["value_dim"],), "out_proj.weight": (hidden, v)}.items()}

    def layer_attention_spec(self, *, use_te: bool):
        """The ``self_attention`` spec of a linear-attention layer: :class:`PackedGatedDeltaNet` with its output norm
        plain (not zero-centred) and, without TransformerEngine, megarl's norms and Megatron's local linears."""
        from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec

        if use_te:
            from megatron.core.extensions.transformer_engine import (
                TELayerNormColumnParallelLinear,
                TENorm,
                TERowParallelLinear,
            )

            in_proj, norm, out_proj, fused = TELayerNormColumnParallelLinear, TENorm, TERowParallelLinear, True
        else:
            from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

            from megarl.models.local_spec import CpuRMSNorm

            in_proj, norm, out_proj, fused = ColumnParallelLinear, CpuRMSNorm, RowParallelLinear, False
        return ModuleSpec(module=gated_delta_net_class(), metainfo={"fuse_input_layernorm": fused},
                          submodules=GatedDeltaNetSubmodules(
                              in_proj=in_proj, out_proj=out_proj,
                              out_norm=ModuleSpec(module=plain_norm(norm), params={})))

    def adapt_layers(self, layer_specs: list, pattern: list[int], offset: int, *, use_te: bool) -> None:
        """Give this stage's linear-attention layers (``layer_specs`` from global layer ``offset``; ``pattern``:
        Megatron's ``linear_attention_freq``, 1 for a linear-attention layer) the Gated DeltaNet mixer; the
        full-attention layers keep theirs."""
        from megatron.core.transformer.identity_op import IdentityOp

        mixer = self.layer_attention_spec(use_te=use_te)
        for index, spec in enumerate(layer_specs):
            if pattern[offset + index]:
                # the input norm is TE's in_proj's in a checkpoint of either spec (as the attention's is linear_qkv's)
                keys = {k: ("self_attention.in_proj.layer_norm_" if k == "input_layernorm." else v)
                        for k, v in spec.submodules.sharded_state_dict_keys_map.items()}
                submodules = dataclasses.replace(spec.submodules, self_attention=mixer, sharded_state_dict_keys_map=keys)
                if mixer.metainfo["fuse_input_layernorm"]:
                    submodules = dataclasses.replace(submodules, input_layernorm=IdentityOp)
                layer_specs[index] = dataclasses.replace(spec, submodules=submodules)


def linear_mixer(layer_spec) -> bool:
    """Whether a Megatron layer spec's mixer is a Gated DeltaNet."""
    module = getattr(layer_spec.submodules.self_attention, "module", None)
    return isinstance(module, type) and module.__name__.endswith("GatedDeltaNet")


def plain_norm(norm):
    """``norm`` (an RMSNorm module class built from a config: megarl's, or TransformerEngine's factory) without the
    config's zero-centred gamma: the Gated DeltaNet's output norm is a plain one in Qwen3.5 and Qwen3-Next whatever
    their other norms are."""
    import copy

    class PlainNorm:
        def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
            config = copy.copy(config)
            config.layernorm_zero_centered_gamma = False
            return norm(config=config, hidden_size=hidden_size, eps=eps, **kwargs)

    PlainNorm.__name__ = PlainNorm.__qualname__ = f"Plain{norm.__name__}"
    return PlainNorm


@functools.cache
def gated_delta_net_class():
    """Megatron's ``GatedDeltaNet`` with packed sequences (THD): Megatron's refuses them. The input and output
    projections run over the whole pack (sequence parallelism as Megatron's); the convolution and the delta rule run
    on the pack's segments as a right-padded batch (each segment from a zero state, as each row of a padded batch;
    right padding never reaches a segment's own tokens: both are causal)."""
    import torch.nn.functional as F
    from megatron.core.ssm import gated_delta_net as gdn

    class PackedGatedDeltaNet(gdn.GatedDeltaNet):
        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                    **kwargs):
            if inference_context is not None or inference_params is not None:
                raise NotImplementedError("PackedGatedDeltaNet: Megatron's inference path is not used by megarl")
            qkvzba, _ = self.in_proj(hidden_states)  # [s, b, local] (the whole sequence under SP)
            qkvzba = qkvzba.transpose(0, 1)  # [b, s, local]
            if packed_seq_params is None:
                out = self._mix(qkvzba)
            else:
                out = self._mix_packed(qkvzba, packed_seq_params)
            out, out_bias = self.out_proj(out.transpose(0, 1).contiguous())
            return out, out_bias

        def _mix_packed(self, qkvzba, params):
            from torch.nn.utils.rnn import pad_sequence

            from megarl.parallel.packing import host_bounds

            bounds = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            bounds = host_bounds(bounds)
            lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
            rows = pad_sequence(list(qkvzba[0].split(lengths)), batch_first=True)  # [segments, longest, local]
            mixed = self._mix(rows)
            return torch.cat([mixed[i, :n] for i, n in enumerate(lengths)])[None]

        def _mix(self, qkvzba):
            """Megatron's Gated DeltaNet between its projections, on ``[b, s, local]``: ``[b, s, local values]``."""
            batch, seq_len, _ = qkvzba.shape
            tp = self.tp_size
            qkv, gate, beta, alpha = torch.split(
                qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp, self.num_value_heads // tp,
                         self.num_value_heads // tp], dim=-1)
            gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
            qkv = self.act_fn(self.conv1d(qkv.transpose(1, 2).contiguous())[..., :seq_len]).transpose(1, 2)
            query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            query = query.reshape(batch, seq_len, -1, self.key_head_dim)
            key = key.reshape(batch, seq_len, -1, self.key_head_dim)
            value = value.reshape(batch, seq_len, -1, self.value_head_dim)
            if self.use_qk_l2norm:
                query, key = gdn.l2norm(query.contiguous()), gdn.l2norm(key.contiguous())
            if self.num_value_heads // self.num_key_heads > 1:
                repeat = self.num_value_heads // self.num_key_heads
                query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
            g = -self.A_log.exp() * F.softplus(alpha.float() + self.dt_bias)
            out, _ = gdn.chunk_gated_delta_rule(query.contiguous(), key.contiguous(), value.contiguous(), g=g,
                                                beta=beta.sigmoid().contiguous(), initial_state=None,
                                                output_final_state=False, use_qk_l2norm_in_kernel=False)
            normed = self._apply_gated_norm(out, gate.contiguous())
            return normed.reshape(batch, seq_len, -1)

    return PackedGatedDeltaNet
