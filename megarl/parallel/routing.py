"""Routing replay and routing comparison for mixture-of-experts models, one forward/backward call at a time.

The rollout engines report the experts they routed every token to (SGLang's ``routed_experts``; the batch's
``rollout_routed_experts`` ``[B, S, num_layers, top_k]``, see :func:`megarl.rollout.manager.routed_experts_tensor`).
A :class:`Routing` given to :func:`megarl.parallel.forward_backward` uses them on every micro-batch:

- **replay**: each MoE layer's router takes the rollout's experts instead of its own top-k (Megatron-Core's
  ``RouterReplay`` of each ``TopKRouter``, built with ``moe_enable_routing_replay``): the token goes to the experts
  that generated it, weighted by the training router's own scores for them, so the router still learns. Before each
  micro-batch's forward the routers get its targets and the action ``REPLAY_FORWARD``; after it, the action
  ``REPLAY_BACKWARD``, so a layer recomputed during the backward pass (``recompute_granularity=full``) pops the
  targets of its own micro-batch, in schedule order, whatever the pipeline interleaving.
- **count_experts**: forward hooks count the tokens each router sends to each expert (load balance; padding
  left out).
- **measure**: forward hooks on the routers count, per batch row, the (token, MoE layer) pairs whose experts differ
  from the rollout's: as routed in this pass (0 under replay) and as the training router would choose by itself
  (its top-k of the gating logits; the same thing without replay). Counts are over the tokens the engine routed:
  each row's tokens but its last.

Token layout: a router sees this rank's tokens ``[s, b]`` flattened s-major: the micro-batch in the model's layout
(:meth:`megarl.parallel.packing.Prepared.to_model`: packed or rotated, CP-split), and with sequence parallelism
only this TP rank's contiguous ``s / tp`` block. Rows' counts are summed over TP, CP and PP ranks by the caller
(:meth:`row_counts` then a sum over those groups: the ranks hold disjoint tokens or layers).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from megarl.parallel.packing import token_mask

ROUTED_EXPERTS = "rollout_routed_experts"
"""The batch key of the rollout's routed experts, ``[B, S, num_layers, top_k]`` (small integer dtype)."""
COUNTS = ("routing_mismatch", "routing_natural_mismatch", "routing_decisions")
"""Per row: (token, MoE layer) pairs routed differently from the rollout in the pass, those the training router
would route differently by itself, and all pairs compared."""


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # Megatron DDP / Float16Module wrappers
        module = module.module
    return module


def routers(chunk: torch.nn.Module) -> list[Any]:
    """The ``TopKRouter`` modules of a (possibly wrapped) model chunk, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = [m for m in _unwrap(chunk).modules() if isinstance(m, TopKRouter)]
    return sorted(found, key=lambda router: router.layer_number)


def routed_mask(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: the tokens an engine routed (each row's tokens but its last, which is never fed back)."""
    mask = attention_mask_BS.bool()
    last = mask.long().cumsum(dim=1) == mask.sum(dim=1, keepdim=True)
    return mask & ~last


@dataclasses.dataclass
class _Context:
    """One chunk's current micro-batch, in this rank's router token order."""

    index: int
    targets: torch.Tensor
    """``[n, num_layers, top_k]`` int64: the rollout's experts."""
    valid: torch.Tensor
    """``[n]`` bool: tokens the engine routed."""
    row: torch.Tensor
    """``[n]`` int64: each token's row in the micro-batch (-1: none)."""
    rows: int


class Routing:
    """Replays (``replay``) and/or measures (``measure``) the rollout's routing over one :func:`forward_backward`
    call (see the module docstring). ``tp_rank``/``tp``/``sequence_parallel``: how this rank's router tokens are
    cut from the micro-batch. Use it for one call; :meth:`close` (the call does it) restores the routers."""

    def __init__(self, chunks: Sequence[torch.nn.Module], *, replay: bool, measure: bool, tp_rank: int = 0,
                 tp: int = 1, sequence_parallel: bool = False, count_experts: bool = False) -> None:
        self.replay, self.measure, self.count_experts = replay, measure, count_experts
        self.tp_rank, self.tp, self.sequence_parallel = tp_rank, tp, sequence_parallel
        self._routers = {id(_unwrap(chunk)): routers(chunk) for chunk in chunks}
        if replay:
            missing = [r.layer_number for rs in self._routers.values() for r in rs if r.router_replay is None]
            if missing:
                raise ValueError(f"routing replay: the routers of layers {missing} were built without "
                                 f"moe_enable_routing_replay (build the model with router_replay=True)")
        self._contexts: dict[int, _Context] = {}
        self._counts: dict[int, torch.Tensor] = {}
        self._real: dict[int, torch.Tensor] = {}
        self.expert_tokens: dict[int, torch.Tensor] = {}
        """With ``count_experts``: per layer number, the tokens this rank's router sent to each expert (forward
        passes only)."""
        self._counting = False
        self._handles = []
        if measure or count_experts:
            for chunk_id, chunk_routers in self._routers.items():
                for router in chunk_routers:
                    self._handles.append(router.register_forward_hook(functools.partial(self._hook, chunk_id)))

    # ------------------------------------------------------------------------ per micro-batch

    def before_forward(self, model: torch.nn.Module, index: int, micro_batch: dict, prepared) -> None:
        """Micro-batch ``index`` is about to run through ``model`` (one chunk): set its routers' targets."""
        chunk_id = id(_unwrap(model))
        chunk_routers = self._routers.get(chunk_id)
        if not chunk_routers:
            return
        self._counting = True
        if self.count_experts:  # the tokens of the micro-batch (not the pack's or the rectangle's padding)
            self._real[chunk_id] = self._router_order(prepared.to_model(token_mask(micro_batch), False))
        if not (self.replay or self.measure):
            return
        routed_BSLK = micro_batch.get(ROUTED_EXPERTS)
        if routed_BSLK is None:
            raise KeyError(f"routing replay/compare needs the batch's {ROUTED_EXPERTS!r} (the engines' routed "
                           f"experts); the micro-batch has {sorted(micro_batch)}")
        layers, topk = routed_BSLK.shape[2:]
        device = micro_batch["input_ids"].device  # the model's (index tensors must be where they index)
        fill = torch.arange(topk, dtype=routed_BSLK.dtype, device=device).expand(layers, topk)
        targets = self._router_order(prepared.to_model(routed_BSLK.to(device), fill)).long()
        B, S = micro_batch["input_ids"].shape
        valid = self._router_order(prepared.to_model(routed_mask(micro_batch["attention_mask"]), False))
        row = self._router_order(prepared.to_model(torch.arange(B, device=device)[:, None].expand(B, S), -1))
        self._contexts[chunk_id] = _Context(index=index, targets=targets, valid=valid, row=row, rows=B)
        if self.replay:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            for router in chunk_routers:
                router.router_replay.set_target_indices(targets[:, router.layer_number - 1].contiguous())
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self) -> None:
        """The micro-batch's forward is done: what runs before the next one is backward (recomputation pops)."""
        self._counting = False
        if self.replay:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            for chunk_routers in self._routers.values():
                for router in chunk_routers:
                    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def _router_order(self, x_bt: torch.Tensor) -> torch.Tensor:
        """``[b, t, ...]`` (model layout) -> ``[n, ...]`` in a router's token order on this rank."""
        x_tb = x_bt.transpose(0, 1)
        if self.sequence_parallel and self.tp > 1:
            block = x_tb.shape[0] // self.tp
            x_tb = x_tb[self.tp_rank * block:(self.tp_rank + 1) * block]
        return x_tb.reshape(-1, *x_tb.shape[2:])

    # ------------------------------------------------------------------------ measurement

    def _hook(self, chunk_id: int, router, args: tuple, output: tuple) -> None:
        if not self._counting:  # a recomputation in the backward pass: counted in its forward already
            return
        _, routing_map = output
        if self.count_experts:
            tokens = routing_map[self._real[chunk_id].to(routing_map.device)].sum(dim=0).to("cpu", torch.float64)
            previous = self.expert_tokens.get(router.layer_number)
            self.expert_tokens[router.layer_number] = tokens if previous is None else previous + tokens
        if not self.measure:
            return
        context = self._contexts[chunk_id]
        if routing_map.shape[0] != context.targets.shape[0]:
            raise RuntimeError(f"routing: layer {router.layer_number}'s router saw {routing_map.shape[0]} tokens, the "
                               f"micro-batch gives this rank {context.targets.shape[0]}")
        target = context.targets[:, router.layer_number - 1]
        rollout = torch.zeros_like(routing_map).scatter_(1, target.to(routing_map.device), True)
        with torch.no_grad():
            logits = router.gating(args[0]).view(routing_map.shape[0], -1)
            natural = natural_routing(router, logits)
        valid = context.valid
        counts = torch.stack([((routing_map != rollout).any(dim=1) & valid).double(),
                              ((natural != rollout).any(dim=1) & valid).double(), valid.double()], dim=1)
        rows = torch.zeros((context.rows, len(COUNTS)), dtype=torch.float64, device=counts.device)
        keep = context.row >= 0
        rows.index_add_(0, context.row[keep], counts[keep])
        previous = self._counts.get(context.index)
        self._counts[context.index] = rows if previous is None else previous + rows

    def row_counts(self, rows_per_micro_batch: Sequence[int]) -> torch.Tensor:
        """``[sum(rows), 3]`` float64 (:data:`COUNTS`) of this rank's routers, the micro-batches' rows in order
        (zeros for micro-batches whose routers are on other ranks), on the host."""
        parts = [self._counts[i].cpu() if i in self._counts else torch.zeros((rows, len(COUNTS)), dtype=torch.float64)
                 for i, rows in enumerate(rows_per_micro_batch)]
        return torch.cat(parts) if parts else torch.zeros((0, len(COUNTS)), dtype=torch.float64)

    def close(self) -> None:
        """Remove the hooks, clear the routers' targets and actions (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.replay:
            for chunk_routers in self._routers.values():
                for router in chunk_routers:
                    router.router_replay.clear_indices()
                    router.router_replay.clear_router_replay_action()
        self._contexts.clear()
        self._counting = False


def natural_routing(router, logits: torch.Tensor) -> torch.Tensor:
    """``[tokens, experts]`` bool: the experts Megatron's ``router`` picks for ``logits`` by itself, whatever it was
    told to replay: its score function (softmax, or a sigmoid plus the expert bias), group-limited selection and
    top-k, as its own ``routing`` computes them (``topk_routing_with_score_function`` without a replay)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    config = router.config
    _, routing_map = topk_routing_with_score_function(
        logits, router.topk, use_pre_softmax=config.moe_router_pre_softmax, num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk, scaling_factor=config.moe_router_topk_scaling_factor,
        score_function=router.score_function, expert_bias=router.expert_bias, router_replay=None)
    return routing_map.bool()
