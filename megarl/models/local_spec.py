"""Megatron's local layer spec as megarl uses it wherever TransformerEngine is not (every CPU run, and CUDA without
TE: a LoRA model's spec on any machine): sequence-parallel norms and a core attention that runs packed sequences and
context parallelism.

7. :class:`CpuRMSNorm` replaces Megatron's torch norm (which refuses sequence parallelism) in the local layer spec
   and as the block's final norm (:func:`local_block_spec`), so sequence parallelism runs without TE. Built on the
   device and in the dtype of the model's other parameters (CUDA without TE included).
8. :func:`core_attention` replaces Megatron's local core attention (which refuses both) with one that runs packed
   sequences (THD, per segment) and context parallelism (an all-gather of keys and values): TransformerEngine's
   attention does these with TE. Its plans (index tensors) live on the queries' device. It computes with torch's
   ``scaled_dot_product_attention`` (flash attention on CUDA: no ``[b, heads, s, s]`` scores stored), Megatron's math
   where that is not the same function (softmax offset, sliding window, attention dropout while training).
"""

from __future__ import annotations

import functools

import torch

from megarl.parallel.megatron_patches import replicated_linear


def local_block_spec(spec, config, *, vp_stage: int | None = None):
    """The transformer block of this rank's pipeline stage (``vp_stage``) from Megatron's local layer ``spec`` (one
    for every layer, or a list with one per layer of the model: dense and mixture-of-experts layers):
    :func:`local_spec` layers and a :class:`CpuRMSNorm` final norm (Megatron's default final norm for the local
    spec is its torch norm, which refuses sequence parallelism)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if not isinstance(spec, list):
        return TransformerBlockSubmodules(layer_specs=[local_spec(spec)] * layers, layer_norm=CpuRMSNorm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = {id(s): local_spec(s) for s in spec}  # each distinct spec once (local_spec edits it in place)
    return TransformerBlockSubmodules(layer_specs=[local[id(s)] for s in spec[offset:offset + layers]],
                                      layer_norm=CpuRMSNorm)


def local_spec(spec):
    """Megatron's local layer ``spec`` with megarl's core attention (:func:`core_attention`: packed
    sequences and context parallelism) and RMSNorms that support sequence parallelism (:class:`CpuRMSNorm`).
    Parameter names do not change. Used wherever TransformerEngine is not (every CPU run)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = CpuRMSNorm
    if getattr(layer.mlp, "module", None) is MoELayer:
        # TransformerEngine's MoE layer keeps its pre-MLP norm under its own name (nothing to fuse it into):
        # checkpoints of either spec hold the same keys.
        layer.sharded_state_dict_keys_map = {k: v for k, v in layer.sharded_state_dict_keys_map.items()
                                             if k != "pre_mlp_layernorm."}
    attention = layer.self_attention.submodules
    attention.core_attention = core_attention()
    for name in ("linear_q_down_proj", "linear_kv_down_proj"):  # multi-latent attention's (point 14)
        if hasattr(attention, name):
            setattr(attention, name, replicated_linear())
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # (kv_layernorm: multi-latent attention's)
        if getattr(attention, name, IdentityOp) is not IdentityOp:
            setattr(attention, name, CpuRMSNorm)
    return spec


class CpuRMSNorm(torch.nn.RMSNorm):
    """7. Megatron's torch norm (``WrappedTorchNorm``) refuses sequence parallelism; this RMSNorm marks its weight
    ``sequence_parallel`` as TransformerEngine's norms do, so Megatron all-reduces its gradient over the TP
    group (each TP rank normalises its own slice of the sequence). Same arguments as ``WrappedTorchNorm``; zero-centred
    (``1 + weight``, fp32 statistics) under the config's ``layernorm_zero_centered_gamma`` as TE's norms are."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"CpuRMSNorm: normalization {config.normalization!r}; megarl's families use RMSNorm")
        # On the model's device and in its dtype, as Megatron builds every other parameter: on CUDA without
        # TransformerEngine this spec is the one in use, and nothing moves or casts the norms later.
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(normalized_shape=hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        if self.zero_centered:  # the weight holds gamma - 1 (Megatron's layernorm_zero_centered_gamma)
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(x)
        normed = torch.nn.functional.rms_norm(x.float(), self.normalized_shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def _packed_attention(attention, base, query, key, value, packed_seq_params, attn_mask_type):
    """``CpuCoreAttention`` over a THD pack: causal attention within each segment, ``base`` (Megatron's local
    attention) run on batches of segments of like length; with CP, the keys and values gathered first."""
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"CpuCoreAttention: packed qkv_format {packed_seq_params.qkv_format!r}; use 'thd'")
    from torch.nn.utils.rnn import pad_sequence

    from megarl.parallel.packing import host_bounds, segment_batches

    bounds = packed_seq_params.cu_seqlens_q_padded
    if bounds is None:
        bounds = packed_seq_params.cu_seqlens_q
    bounds = host_bounds(bounds)  # no device sync per layer: the host copy recorded with the pack
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # Attention.forward squeezed the batch dimension of THD: [t, heads, dim]. Views per segment (a split's
    # backward is one concatenation; a slice's, a zero tensor of the whole pack per segment).

    rank = torch.distributed.get_rank(attention.cp_group) if attention.cp > 1 else 0
    if attention.cp > 1:
        key, value = attention._gather(key, value, lengths)
    queries = query.split([n // attention.cp for n in lengths])
    keys, values = key.split(lengths), value.split(lengths)
    plan = segment_batches(lengths, heads=query.shape[-2], cp=attention.cp, rank=rank, device=query.device)
    outs = []
    for batch in plan.batches:
        picked = batch.segments
        if len(picked) == 1 and batch.query_positions is None:
            (i,) = picked
            out = base(queries[i].unsqueeze(1), keys[i].unsqueeze(1), values[i].unsqueeze(1), None,
                       attn_mask_type=attn_mask_type)
            outs.append(out.squeeze(1))
            continue
        q, k, v = (pad_sequence([parts[i] for i in picked]) for parts in (queries, keys, values))
        mask = None  # cp == 1: as many queries as keys, Megatron's causal mask
        if batch.query_positions is not None:
            keys_k = torch.arange(k.shape[0], device=k.device)
            mask = (keys_k[None, None, :] > batch.query_positions[:, :, None])[:, None]
        out = base(q, k, v, mask, attn_mask_type=attn_mask_type)  # [Lq, n, h·d]
        outs.append(out.transpose(0, 1).reshape(-1, out.shape[-1]).index_select(0, batch.output_index))
    return torch.cat(outs).index_select(0, plan.restore).unsqueeze(1)


@functools.cache
def core_attention():
    """:class:`CpuCoreAttention` (built on first use: it subclasses Megatron's local attention, and this module is
    imported before Megatron)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CpuCoreAttention(DotProductAttention):
        """8. Megatron's local core attention with packed sequences and context parallelism (TransformerEngine's
        attention does both on GPU; Megatron's local one refuses them).

        - Packed (THD, ``PackedSeqParams``): causal attention within each segment (bounds from
          ``cu_seqlens_q_padded``), Megatron's own math per segment: cost Σ len², no block mask over the pack.
        - Context parallel (``cp > 1``): the keys and values of the CP group are all-gathered (autograd: the
          backward reduce-scatters their gradients to their owners), put back in sequence order, and each local
          query attends causally by its global position in the 2·cp zigzag split
          (:func:`megarl.parallel.packing.zigzag_index`): of the padded row, or of each segment when packed.
          TransformerEngine's ``all_gather`` CP communication, in plain torch.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
            # k_channels / v_channels: multi-latent attention's query-key and value widths (TransformerEngine's
            # attention takes them; Megatron's local one does not). Attention here reads them off the tensors;
            # its output is heads × kv_channels wide, which an MLA family sets to the value width.
            import copy

            self.cp = config.context_parallel_size
            local = copy.copy(config)
            local.context_parallel_size = 1  # the base class accepts only that; the CP split is handled here
            super().__init__(local, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            self.cp_group = None
            if self.cp > 1:
                self.cp_group = getattr(pg_collection, "cp", None)
                if self.cp_group is None:
                    from megatron.core import parallel_state

                    self.cp_group = parallel_state.get_context_parallel_group()

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            base = self._attend
            if packed_seq_params is None:
                if self.cp == 1:
                    return base(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                attention_bias=attention_bias)
                length = query.shape[0] * self.cp
                keys, values = self._gather(key, value, [length])
                return base(query, keys, values, self._causal(length, query.device), attn_mask_type=attn_mask_type)
            return _packed_attention(self, base, query, key, value, packed_seq_params, attn_mask_type)

        def _attend(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None):
            return _attend(self, DotProductAttention.forward, query, key, value, attention_mask,
                           attn_mask_type=attn_mask_type, attention_bias=attention_bias)

        def _gather(self, key, value, lengths):
            return _gather_cp(self, key, value, lengths)

        def _causal(self, length: int, device: torch.device) -> torch.Tensor:
            return _causal_cp(self, length, device)

    return CpuCoreAttention


def _attend(attention, base_forward, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None):
    """Megatron's local attention (``[s, b, heads, dim]`` in, ``[s, b, heads·dim]`` out; ``attention_mask``
    True where masked, else causal) computed by torch's ``scaled_dot_product_attention``: one kernel that
    stores no ``[b, heads, s, s]`` scores (flash attention on CUDA), the same function. Megatron's own math
    where SDPA is not the same: a softmax offset, a sliding window, an attention bias, or attention dropout
    while training (whose randomness Megatron draws from its TP-aware RNG tracker)."""
    from megatron.core.transformer.enums import AttnMaskType

    softmax = attention.scale_mask_softmax
    if (attention_bias is not None or attention.softmax_offset is not None or softmax.window_size is not None
            or (attention.training and attention.attention_dropout.p > 0)):
        return base_forward(attention, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads, in order
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # Megatron's mask type is the layer's (the argument is unused there too); causal needs no mask tensor.
    causal = attention_mask is None and attention.attn_mask_type == AttnMaskType.causal and q.shape[2] > 1
    keep = None if attention_mask is None else ~attention_mask.to(torch.bool)
    scale = attention.softmax_scale * (softmax.scale or 1.0)  # query-key layer scaling: divided, then multiplied
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal,
                                                           scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _gather_cp(attention, key, value, lengths):
    """The CP group's keys and values in sequence order (sequences of ``lengths`` tokens, end to end)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from megarl.parallel.packing import cp_inverse

    inverse = cp_inverse(lengths, attention.cp, key.device)
    return [gather_from_sequence_parallel_region(t.contiguous(), group=attention.cp_group).index_select(0, inverse)
            for t in (key, value)]


def _causal_cp(attention, length: int, device: torch.device) -> torch.Tensor:
    """The mask (True: masked) of this rank's queries of one sequence of ``length`` tokens over all its keys,
    on ``device``."""
    from megarl.parallel.packing import zigzag_index

    rank = torch.distributed.get_rank(attention.cp_group)
    mine = zigzag_index([length], attention.cp, rank).to(device)
    return (torch.arange(length, device=device)[None, :] > mine[:, None])[None, None]
