"""Rank-side job of the packing / context-parallel tests: the same log-probs and PPO step packed or padded, with
and without context parallelism (4 gloo ranks, layouts re-initialised in the same processes)."""

from __future__ import annotations

import torch

from tests.distributed.sharded_model_jobs import NUM_ROWS, SEQ, _rows

LAYOUTS = [
    # (tp, pp, cp, sequence_parallel, packed): 4 ranks; dp = 4 / (tp·pp·cp)
    (1, 1, 1, False, True),
    (1, 1, 2, False, False),
    (1, 1, 2, False, True),
    (2, 1, 2, False, True),
    (1, 2, 2, False, True),
    (2, 1, 1, False, True),
    (2, 1, 1, True, True),
    (2, 1, 1, True, False),
]
REFERENCE = LAYOUTS[0]
CRITIC_LAYOUTS = [(1, 1, 1, False, False), (1, 1, 1, False, True), (1, 1, 2, False, True), (2, 1, 2, False, True),
                  (1, 2, 2, False, True)]
CRITIC_REFERENCE = CRITIC_LAYOUTS[0]
LOSS_AGG_MODE = "seq-mean-token-mean"  # per-row means: each CP rank's loss must see whole rows


def packing_cp_job(hf_dir: str, batch: dict, critic_batch: dict, layouts=tuple(LAYOUTS),
                   critic_layouts=tuple(CRITIC_LAYOUTS)) -> dict:
    out = {layout: _actor(hf_dir, batch, layout) for layout in layouts}
    out.update({("critic", *layout): _critic(hf_dir, critic_batch, layout) for layout in critic_layouts})
    return out


def _dims(layout):
    from megarl.parallel import ParallelDims

    tp, pp, cp, sp, _ = layout
    return ParallelDims(tp=tp, pp=pp, cp=cp, sequence_parallel=sp)


def _optim():
    from megarl.config import OptimConfig

    return OptimConfig(lr=1e-3, eps=1e-3, clip_grad=1.0)


def _gather_rows(holds: bool, rows: list[int], values: torch.Tensor) -> torch.Tensor:
    """Every rank gets the rows the holding ranks computed (``values`` is [N, ...], filled at ``rows``)."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (holds, rows, values))
    full = torch.zeros_like(values)
    for held, their_rows, their_values in gathered:
        if held:
            full[their_rows] = their_values[their_rows]
    return full


def _actor(hf_dir: str, batch: dict, layout) -> dict:
    from megarl.algo.losses import agg_norm, policy_loss
    from megarl.workers.sharded_model import ShardedModel

    global_norm = agg_norm(batch["loss_mask"], LOSS_AGG_MODE)
    sharded = ShardedModel(hf_dir, _dims(layout), optim=_optim(), packed=layout[-1])
    groups = sharded.groups
    dp = groups.dims.dp
    mine_rows = list(range(groups.dp_rank, NUM_ROWS, dp))
    micro = [_rows(batch, slice(i, i + 1)) for i in mine_rows]
    fwd = sharded.forward_logprobs(micro, temperature=1.0)
    logp = torch.zeros(NUM_ROWS, SEQ)
    if fwd is not None:
        for i, o in zip(mine_rows, fwd):
            logp[i] = o["logp"][0]
    # Each DP replica's last stage, CP rank 0, TP rank 0 holds its rows.
    full = _gather_rows(fwd is not None and groups.cp_rank == 0 and groups.tp_rank == 0, mine_rows, logp)
    old_logp = full + batch["old_logp_shift"]

    def loss_fn(logp_BS, entropy_BS, mb):
        return policy_loss(logp_BS, mb["old_logp"], mb["advantages"], mb["loss_mask"],
                           loss_agg_mode=LOSS_AGG_MODE, global_norm=global_norm,
                           entropy_BT=entropy_BS, entropy_coeff=0.01)

    rows = [{**_rows(batch, slice(i, i + 1)), "old_logp": old_logp[i : i + 1]} for i in mine_rows]
    step = sharded.train_step(rows, loss_fn)
    weights = {n: t.clone() for b in sharded.exporter().iter_full(1 << 22) for n, t in b}
    return {"logp": full, "loss": step.loss, "grad_norm": step.grad_norm, "applied": step.applied,
            "weights": weights if groups.rank == 0 else None,
            "dims": (groups.dims.tp, groups.dims.pp, groups.dims.cp, groups.dims.dp),
            "local_tokens": sharded_inputs(sharded, micro[0]),
            "sequence_parallel_params": sorted(n for c in sharded.module_chunks for n, p in c.named_parameters()
                                               if getattr(p, "sequence_parallel", False))}


def _critic(hf_dir: str, batch: dict, layout) -> dict:
    """Values and one clipped value-loss update of the critic (``CriticRole``) at ``layout``."""
    from megarl.config import CriticConfig
    from megarl.data.batch import Batch
    from megarl.workers.critic import CriticRole
    from megarl.workers.sharded_model import ShardedModel
    from tests.distributed.critic_jobs import SEED

    sharded = ShardedModel(hf_dir, _dims(layout), optim=_optim(), seed=SEED, value_head=True, packed=layout[-1])
    groups = sharded.groups
    dp = groups.dims.dp
    per_rank = len(batch["input_ids"]) // dp
    mine = Batch(tensors=batch).shard(groups.dp_rank, dp)
    critic = CriticRole(sharded, CriticConfig(ppo_mini_batch_size=len(batch["input_ids"]),
                                              ppo_micro_batch_size_per_gpu=1, forward_micro_batch_size_per_gpu=2,
                                              cliprange_value=0.2, loss_agg_mode=LOSS_AGG_MODE))
    values = critic.compute_values(mine)
    rows = list(range(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank))
    local = torch.zeros(batch["response_mask"].shape)
    if values is not None:
        local[rows] = values["values"]
    full = _gather_rows(values is not None, rows, local)
    (step,) = critic.update(mine)
    weights = {n: t.clone() for b in sharded.exporter().iter_full(1 << 22) for n, t in b}
    head = sharded.module_chunks[-1].output_layer if groups.is_last_stage else None
    weights.update({} if head is None else {"head.weight": head.weight.detach().clone(),
                                            "head.bias": head.bias.detach().clone()})
    return {"values": full, "loss": step.loss, "grad_norm": step.grad_norm, "applied": step.applied,
            "weights": weights if groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0 else None}


def sharded_inputs(sharded, micro_batch: dict) -> int:
    """How many tokens of ``micro_batch`` this rank's model input holds (the CP split's share)."""
    from megarl.parallel.packing import pack_alignment, prepare_packed, prepare_padded
    from megarl.parallel.pipeline import cp_layout

    cp, rank, _ = cp_layout(sharded.groups)
    seg, total = pack_alignment(cp=cp, tp=sharded.groups.dims.tp, sequence_parallel=sharded.config.sequence_parallel)
    if sharded.packed:
        return prepare_packed(micro_batch, seg_align=seg, total_align=total, cp=cp, cp_rank=rank).input_ids.numel()
    return prepare_padded(micro_batch, total_align=total, cp=cp, cp_rank=rank).input_ids.numel()
