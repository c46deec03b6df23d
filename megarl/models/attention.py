"""Attention variants of a family beyond Llama's, as a sub-spec of its entry (as :mod:`megarl.models.mla` is for
multi-latent attention): what the HF config says, which Megatron submodules the layer spec takes instead of its
defaults, and which weight rules change.

Query and key norms over all heads (MiniMax-M2)
-----------------------------------------------
Qwen3's q/k norms normalise each head by itself (Megatron's ``qk_layernorm``, one weight of ``head_dim``).
MiniMax-M2's normalise the whole query projection (``num_attention_heads × head_dim``) and the whole key projection
(``num_key_value_heads × head_dim``) before the heads are split, each with a weight of that width (transformers'
``q_norm`` / ``k_norm`` over ``q_proj`` / ``k_proj``'s output; SGLang's ``MiniMaxM2RMSNormTP``).
:class:`AllHeadsRMSNorm` takes the place of Megatron's per-head norm in the layer spec: under tensor parallelism a
rank holds its heads and their slice of the weight (split by head, as the heads are: the rules' ``Split.COLUMN``),
and the mean of squares is summed over the tensor-parallel group (an all-reduce whose backward all-reduces too:
every rank's output depends on every rank's input). Sequence parallelism does not touch it (attention sees the
whole sequence and its own heads); the weight's gradient is this rank's alone.
"""

from __future__ import annotations

import dataclasses

import torch

QK_NORM_PER_HEAD, QK_NORM_ALL_HEADS = "per_head", "all_heads"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """A family's attention where it is not Llama's (grouped-query attention with optional per-head q/k norms)."""

    qk_norm: str = QK_NORM_PER_HEAD
    """Where the family's q/k norms (if it has them) normalise: ``per_head`` (Qwen3, GLM-4.5), or ``all_heads``
    (MiniMax-M2: one norm over the whole projection, :class:`AllHeadsRMSNorm`)."""
    output_gate: bool = False
    """The attention's output is multiplied by ``sigmoid`` of a gate the query projection also makes (Qwen3.5,
    Qwen3-Next: ``q_proj`` holds per head its query then its gate; Megatron's ``attention_output_gate``)."""

    @property
    def qk_norm_all_heads(self) -> bool:
        """Whether the q/k norms normalise all heads at once (their weights split by head: the family's weight
        rules, :func:`megarl.models.weights.decoder_weights`)."""
        return self.qk_norm == QK_NORM_ALL_HEADS

    def adapt_layer(self, layer_spec) -> None:
        """Put this attention's submodules into a Megatron layer spec (after :func:`megarl.models.local_spec.
        local_spec` or TransformerEngine's spec chose theirs)."""
        if not self.qk_norm_all_heads:
            return
        from megatron.core.transformer.spec_utils import ModuleSpec

        attention = layer_spec.submodules.self_attention.submodules
        attention.q_layernorm = ModuleSpec(module=AllHeadsRMSNorm, params={"part": "query"})
        attention.k_layernorm = ModuleSpec(module=AllHeadsRMSNorm, params={"part": "key"})


class AllHeadsRMSNorm(torch.nn.Module):
    """RMSNorm over all heads of a query or key projection (``part``), split over tensor-parallel ranks by head (see
    the module docstring). Built by Megatron's attention as its ``q_layernorm`` / ``k_layernorm``: ``hidden_size`` is
    the head width it passes; the heads come from ``config``. Input ``[..., heads on this rank, head_dim]``; fp32
    statistics, the weight applied in the input's dtype (transformers' order)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, *, part: str):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        heads = config.num_attention_heads if part == "query" else config.num_query_groups
        tp = config.tensor_model_parallel_size
        self.eps, self.width = eps, heads * hidden_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(heads // tp * hidden_size, device=device,
                                                    dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        squares = y.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.tp > 1:
            from megatron.core import parallel_state

            squares = _SumOverGroup.apply(squares, parallel_state.get_tensor_model_parallel_group())
        y = y * torch.rsqrt(squares / self.width + self.eps)
        return self.weight.view(x.shape[-2], x.shape[-1]) * y.to(dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The weight as a tensor-parallel shard (axis 0) in Megatron's distributed checkpoints (a plain module's
        default would save it as replicated and keep one rank's slice)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


class _SumOverGroup(torch.autograd.Function):
    """A sum over ``group`` whose backward sums the gradients over it too (each rank's output feeds its own loss
    terms, and every rank's input reaches every output)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None
