"""Mixture-of-Experts in a family entry: which HF config fields describe the experts, and which layers have them.

A :class:`MoESpec` is part of a :class:`~megarl.models.family.ModelFamily`: the HF config keys of the expert count,
top-k, expert FFN size and router normalisation, the HF module and tensor names of the experts (hub layout: one
tensor per expert, as ``save_pretrained`` writes them and SGLang loads them), and the rule that says which layers
are sparse. The family derives Megatron's MoE settings and the expert weight rules from it.

Router mapping (measured against HF's routers): HF routers take the softmax over all experts, then the top-k;
with ``norm_topk_prob`` (Qwen3-MoE) or always (Mixtral) the k weights are renormalised, which is Megatron's top-k
then softmax over the k logits (``moe_router_pre_softmax=False``); without it the weights stay the full softmax's
(``moe_router_pre_softmax=True``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESpec:
    """How one family's HF config and checkpoint describe its experts."""

    experts_key: str
    """HF config key of the number of routed experts (``num_experts``, ``num_local_experts``)."""
    ffn_key: str
    """HF config key of one expert's FFN size (``moe_intermediate_size``; Mixtral's ``intermediate_size``)."""
    topk_key: str = "num_experts_per_tok"
    norm_topk_key: str | None = None
    """HF config key saying whether the top-k weights are renormalised; None: they always are (Mixtral)."""
    block: str = "mlp"
    """The HF module of a sparse layer's MLP (``mlp``; Mixtral's ``block_sparse_moe``)."""
    expert_tensors: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """An expert's gate, up and down projections (Mixtral: ``w1``, ``w3``, ``w2``)."""
    sparse_step_key: str | None = None
    """HF config key: every n-th layer is sparse (Qwen3-MoE's ``decoder_sparse_step``)."""
    dense_layers_key: str | None = None
    """HF config key: the layers that keep a dense MLP (Qwen3-MoE's ``mlp_only_layers``)."""
    shared_expert_key: str | None = None
    """HF config key of the shared expert's FFN size (Qwen2-MoE's ``shared_expert_intermediate_size``: one dense
    SwiGLU MLP every token goes through beside its routed experts, ``shared_expert.{gate,up,down}_proj``); None: no
    shared expert."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE; Megatron's
    ``moe_shared_expert_gate``)."""
    shared_experts_count_key: str | None = None
    """HF config key of how many shared experts of the routed experts' size there are (GLM-4.5's
    ``n_shared_experts``: one MLP of that many times the size)."""
    shared_expert_module: str = "shared_expert"
    """The shared expert's HF module in a sparse layer's MLP (GLM-4.5: ``shared_experts``)."""
    score_function: str = "softmax"
    """The router's scores: ``softmax`` over all experts, or ``sigmoid`` per expert (GLM-4.5; the top-k weights then
    renormalised, Megatron's ``moe_router_score_function``)."""
    expert_bias: bool = False
    """The router adds a per-expert bias to the scores it picks the top-k by, not to the weights (aux-loss-free
    balancing: HF's ``gate.e_score_correction_bias``, Megatron's ``router.expert_bias`` buffer)."""
    expert_bias_tensor: str = "gate.e_score_correction_bias"
    """Where a sparse layer's MLP keeps that bias (GLM-4.5's router's ``gate.e_score_correction_bias``; MiniMax-M2's
    MLP block its own ``e_score_correction_bias``), in the checkpoint and in transformers' memory alike."""
    scaling_key: str | None = None
    """HF config key of the factor the routed experts' weights are multiplied by (``routed_scaling_factor``)."""
    first_dense_key: str | None = None
    """HF config key: the first that many layers keep a dense MLP (``first_k_dense_replace``)."""
    group_keys: tuple[str, str] | None = None
    """HF config keys of group-limited routing: the number of expert groups and of groups a token picks
    (``n_group``, ``topk_group``: Megatron's ``moe_router_num_groups`` / ``moe_router_group_topk``)."""

    def shared_ffn_size(self, hf_config) -> int:
        """The shared expert's FFN size (0 without one)."""
        if self.shared_experts_count_key:
            return int(getattr(hf_config, self.shared_experts_count_key, 0) or 0) * self.ffn_size(hf_config)
        return int(getattr(hf_config, self.shared_expert_key, 0) or 0) if self.shared_expert_key else 0

    def scaling(self, hf_config) -> float:
        """The routed weights' factor (1 without one)."""
        return float(getattr(hf_config, self.scaling_key, 1.0) or 1.0) if self.scaling_key else 1.0

    def groups(self, hf_config) -> tuple[int, int] | None:
        """``(groups, groups picked)`` of group-limited routing; None when every expert is one group."""
        if self.group_keys is None:
            return None
        groups, picked = (int(getattr(hf_config, key, 1) or 1) for key in self.group_keys)
        return None if groups <= 1 else (groups, picked)

    def num_experts(self, hf_config) -> int:
        return int(getattr(hf_config, self.experts_key))

    def topk(self, hf_config) -> int:
        return int(getattr(hf_config, self.topk_key))

    def ffn_size(self, hf_config) -> int:
        return int(getattr(hf_config, self.ffn_key))

    def renormalises(self, hf_config) -> bool:
        """Whether the top-k weights are renormalised to sum to one."""
        return True if self.norm_topk_key is None else bool(getattr(hf_config, self.norm_topk_key))

    def sparse_layers(self, hf_config) -> tuple[bool, ...]:
        """Per layer: True where the MLP is a mixture of experts (HF's rule for this family)."""
        layers = int(hf_config.num_hidden_layers)
        step = int(getattr(hf_config, self.sparse_step_key, 1) or 1) if self.sparse_step_key else 1
        dense = set(getattr(hf_config, self.dense_layers_key, None) or []) if self.dense_layers_key else set()
        first = int(getattr(hf_config, self.first_dense_key, 0) or 0) if self.first_dense_key else 0
        experts = self.num_experts(hf_config)
        return tuple(experts > 0 and i not in dense and i >= first and (i + 1) % step == 0 for i in range(layers))

    def hub_shapes(self, hf_config) -> dict[str, tuple[int, ...]]:
        """Shapes of the router and expert tensors as the checkpoint holds them (one tensor per expert), by HF name
        (transformers fuses the experts in memory: ``experts.gate_up_proj [E, 2F, H]``)."""
        hidden, experts, ffn = int(hf_config.hidden_size), self.num_experts(hf_config), self.ffn_size(hf_config)
        gate, up, down = self.expert_tensors
        out: dict[str, tuple[int, ...]] = {}
        for layer, sparse in enumerate(self.sparse_layers(hf_config)):
            if sparse:
                block = f"model.layers.{layer}.{self.block}."
                out[block + "gate.weight"] = (experts, hidden)
                for e in range(experts):
                    out[f"{block}experts.{e}.{gate}.weight"] = out[f"{block}experts.{e}.{up}.weight"] = (ffn, hidden)
                    out[f"{block}experts.{e}.{down}.weight"] = (hidden, ffn)
                if self.expert_bias:
                    out[block + self.expert_bias_tensor] = (experts,)
                shared, module = self.shared_ffn_size(hf_config), f"{block}{self.shared_expert_module}."
                if shared:
                    out[f"{module}gate_proj.weight"] = (shared, hidden)
                    out[f"{module}up_proj.weight"] = (shared, hidden)
                    out[f"{module}down_proj.weight"] = (hidden, shared)
                    if self.shared_expert_gate:
                        out[f"{block}shared_expert_gate.weight"] = (1, hidden)
        return out

    def hub_views(self, params: dict[str, "torch.Tensor"], hf_config) -> dict[str, "torch.Tensor"]:
        """Views, under the checkpoint's names (one tensor per expert, as SGLang loads them), of the tensors of a
        transformers model whose ``params`` (``named_parameters()``) hold the experts fused in memory
        (``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj [E, H, F]``): writing a view writes the model's
        weight. Names the model already has are left out."""
        ffn = self.ffn_size(hf_config)
        gate, up, down = self.expert_tensors
        out = {}
        for layer, sparse in enumerate(self.sparse_layers(hf_config)):
            memory, block = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.{self.block}."
            fused_up, fused_down = params.get(memory + "experts.gate_up_proj"), params.get(memory + "experts.down_proj")
            if not sparse or fused_up is None or fused_down is None:
                continue
            for tensor in ("gate.weight", self.expert_bias_tensor):  # under the checkpoint's block name
                if block + tensor not in params and memory + tensor in params:
                    out[block + tensor] = params[memory + tensor].data
            for e in range(fused_up.shape[0]):
                out[f"{block}experts.{e}.{gate}.weight"] = fused_up.data[e, :ffn]
                out[f"{block}experts.{e}.{up}.weight"] = fused_up.data[e, ffn:]
                out[f"{block}experts.{e}.{down}.weight"] = fused_down.data[e]
        return out

    def check(self, hf_config) -> None:
        """Refuse what megarl does not map, naming the HF config key."""
        experts, topk = self.num_experts(hf_config), self.topk(hf_config)
        if not 0 < topk <= experts:
            raise ValueError(f"{self.topk_key}={topk} in the HF config: it must be in 1..{self.experts_key}={experts}")
        jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
        if jitter:
            raise ValueError(f"router_jitter_noise={jitter} in the HF config multiplies the hidden states by noise "
                             f"in training, which Megatron's router does not do; set it to 0")
        groups = self.groups(hf_config)
        if groups is not None and (experts % groups[0] or topk // groups[1] != 2):
            raise ValueError(f"{self.group_keys[0]}={groups[0]}, {self.group_keys[1]}={groups[1]} with "
                             f"{self.topk_key}={topk} in the HF config: megarl maps group-limited routing where the "
                             f"groups split the {experts} experts evenly and each group is scored by its top 2 "
                             f"(Megatron's top {self.topk_key} / {self.group_keys[1]}), as DeepSeek-V3's 8 of 4 groups")
        if self.score_function == "sigmoid" and topk > 1 and not self.renormalises(hf_config):
            raise ValueError(f"{self.norm_topk_key}=false in the HF config: Megatron renormalises a sigmoid router's "
                             f"top-k weights; this checkpoint is not supported")
        for key in ("shared_expert_intermediate_size", "n_shared_experts"):
            if key not in (self.shared_expert_key, self.shared_experts_count_key) and getattr(hf_config, key, None):
                raise ValueError(f"{key}={getattr(hf_config, key)} in the HF config: shared experts are not mapped "
                                 f"for this family")


def prepare_expert_bias(model) -> int:
    """Routers of ``model`` that add an expert bias (aux-loss-free balancing) count tokens as their bias update needs.

    With Megatron's ``moe_router_bias_update_rate`` at 0 (the default: the checkpoint's bias is kept, as slime's
    GLM-4.5 and DeepSeek-V3 RL recipes keep it) nothing is counted. With a rate, each training forward adds the
    experts its real tokens were routed to (:func:`count_routed_tokens`: padding left out) to the router's
    ``local_tokens_per_expert``, kept in fp32; Megatron's ``finalize_model_grads`` then all-reduces the counts over
    TP × DP × CP at the end of each optimizer step's forward-backward and moves each expert's bias by the rate
    towards the mean load (``bias += rate · sign(mean - count)``), before the step, and zeroes them. This
    replaces Megatron-Core 0.16.1's counting, which fails on packed or padded micro-batches (it masks the
    ``[T, E]`` routing map with the ``[T]`` padding mask, which does not broadcast), and lets the bf16 model's
    cast make the counts bf16 (whole numbers above 256 then round). The bias is a persistent fp32 buffer:
    checkpointed and resumed with the model. Returns how many routers."""
    from megatron.core.transformer.moe.router import TopKRouter

    count = 0
    for module in model.modules():
        if isinstance(module, TopKRouter) and module.enable_expert_bias:
            module._apply_expert_bias = functools.partial(_count_for_bias, module)
            count += 1
    return count


def count_routed_tokens(routing_map: "torch.Tensor", padding_mask: "torch.Tensor | None") -> "torch.Tensor":
    """Tokens routed to each expert (fp32 ``[E]``) from a ``[T, E]`` routing map, leaving out the tokens that
    ``padding_mask`` (``[T]`` or any shape of ``T`` elements, True on padding) marks."""
    import torch

    if padding_mask is not None:
        routing_map = routing_map & ~padding_mask.reshape(-1, 1).bool()
    return routing_map.sum(dim=0, dtype=torch.float32)


def _count_for_bias(router, routing_map, padding_mask=None) -> None:
    """A router's ``_apply_expert_bias`` (see :func:`prepare_expert_bias`)."""
    import torch

    if not router.config.moe_router_bias_update_rate or not torch.is_grad_enabled():
        return
    with torch.no_grad():
        counts = router.local_tokens_per_expert
        if counts.dtype != torch.float32:  # the model's cast to bf16 reached the buffer
            router.local_tokens_per_expert = counts = counts.float()
        counts += count_routed_tokens(routing_map, padding_mask)
