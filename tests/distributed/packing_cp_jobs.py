"""Rank-side job of the packing / context-parallel tests: the same log-probs and PPO step packed or padded, with
and without context parallelism (4 gloo ranks, layouts re-initialised in the same processes)."""

from __future__ import annotations

import torch

from tests.distributed.sharded_model_jobs import NUM_ROWS, SEQ, _rows

LAYOUTS = [
    # (tp, pp, cp, packed): 4 ranks; dp = 4 / (tp·pp·cp)
    (1, 1, 1, True),
    (1, 1, 2, False),
    (1, 1, 2, True),
    (2, 1, 2, True),
    (1, 2, 2, True),
]
REFERENCE = LAYOUTS[0]


def packing_cp_job(hf_dir: str, batch: dict, layouts=tuple(LAYOUTS)) -> dict:
    from megarl.algo.losses import agg_norm, policy_loss
    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel

    global_norm = agg_norm(batch["loss_mask"], "token-mean")
    out = {}
    for tp, pp, cp, packed in layouts:
        sharded = ShardedModel(hf_dir, ParallelDims(tp=tp, pp=pp, cp=cp),
                               optim=OptimConfig(lr=1e-3, eps=1e-3, clip_grad=1.0), packed=packed)
        groups = sharded.groups
        dp = groups.dims.dp
        mine_rows = list(range(groups.dp_rank, NUM_ROWS, dp))
        micro = [_rows(batch, slice(i, i + 1)) for i in mine_rows]
        fwd = sharded.forward_logprobs(micro, temperature=1.0)
        logp = torch.zeros(NUM_ROWS, SEQ)
        if fwd is not None:
            for i, o in zip(mine_rows, fwd):
                logp[i] = o["logp"][0]
        # Every rank gets every row's log-probs (each DP replica's last stage, CP rank 0, holds its rows).
        holds = fwd is not None and groups.cp_rank == 0 and groups.tp_rank == 0
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (holds, mine_rows, logp))
        full = torch.zeros(NUM_ROWS, SEQ)
        for held, rows, values in gathered:
            if held:
                full[rows] = values[rows]
        old_logp = full + batch["old_logp_shift"]

        def loss_fn(logp_BS, entropy_BS, mb):
            return policy_loss(logp_BS, mb["old_logp"], mb["advantages"], mb["loss_mask"],
                               loss_agg_mode="token-mean", global_norm=global_norm,
                               entropy_BT=entropy_BS, entropy_coeff=0.01)

        rows = [{**_rows(batch, slice(i, i + 1)), "old_logp": old_logp[i : i + 1]} for i in mine_rows]
        step = sharded.train_step(rows, loss_fn)
        weights = {n: t.clone() for b in sharded.exporter().iter_full(1 << 22) for n, t in b}
        out[(tp, pp, cp, packed)] = {"logp": full, "loss": step.loss, "grad_norm": step.grad_norm,
                                     "applied": step.applied, "weights": weights if groups.rank == 0 else None,
                                     "dims": (groups.dims.tp, groups.dims.pp, groups.dims.cp, groups.dims.dp),
                                     "local_tokens": sharded_inputs(sharded, micro[0])}
    return out


def sharded_inputs(sharded, micro_batch: dict) -> int:
    """How many tokens of ``micro_batch`` this rank's model input holds (the CP split's share)."""
    from megarl.parallel.packing import pack_alignment, prepare_packed, prepare_padded
    from megarl.parallel.pipeline import _cp_layout

    cp, rank, _ = _cp_layout(sharded.groups)
    seg, total = pack_alignment(cp=cp, tp=sharded.groups.dims.tp, sequence_parallel=False)
    if sharded.packed:
        return prepare_packed(micro_batch, seg_align=seg, total_align=total, cp=cp, cp_rank=rank).input_ids.numel()
    return prepare_padded(micro_batch, total_align=total, cp=cp, cp_rank=rank).input_ids.numel()
