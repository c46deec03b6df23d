"""Per-token log-probabilities and entropy from vocabulary-sharded logits, without gathering V.

Each tensor-parallel rank holds logits for a contiguous slice of the (padded) vocabulary.
The softmax normaliser, the target logit and the entropy's expectation are each reduced
across the TP group with one all-reduce of a [...]-shaped tensor; the [..., V] logits are
never gathered. A custom autograd function keeps only the local probabilities for the
backward pass, which needs no communication: every TP rank receives the same upstream
gradient for the (replicated) outputs, and each rank's logit gradient depends only on its
own probabilities and the replicated scalars.

Shapes: ``logits_shard`` is [..., V/tp]; ``target_ids`` and both outputs are [...].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 24
"""Logit elements (rows × V/tp) one chunk of rows handles at a time: 64 MiB per fp32 temporary. The fp32
copies of the logits that the softmax needs exist one chunk at a time, never for all T rows (Qwen's 152k
vocabulary at TP=2 and a 32k-token pack would otherwise hold ~10 GB per copy)."""


def _row_chunks(rows: int, width: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, max(rows, 1), step)]


def _scaled(logits_nV: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new fp32 tensor of ``logits / temperature``."""
    z = logits_nV.float()
    if z.data_ptr() == logits_nV.data_ptr():  # fp32 logits: .float() is the tensor itself
        z = z.clone()
    return z if temperature == 1.0 else z.div_(temperature)


class _VocabParallelLogProb(torch.autograd.Function):
    """Rows are processed in chunks (:data:`CHUNK_ELEMENTS`); each row's numbers are those of the whole-tensor
    computation. Padded vocabulary columns (at or past ``vocab_size``, the tail of the last ranks' shards) are left
    out by slicing. Each rank normalises by its own maximum; the ranks' sums are rescaled to the group's maximum
    after one all-reduce of the maxima, so the logits are read once in the forward. The backward recomputes the
    probabilities from the logits (kept anyway) chunk by chunk, in place, instead of keeping an fp32 ``[T, V/tp]``
    copy between forward and backward; without an entropy gradient it skips the entropy's terms."""

    @staticmethod
    def forward(ctx, logits_shard, target_ids, temperature, vocab_start, vocab_size, group):
        ctx.set_materialize_grads(False)
        local_v = logits_shard.shape[-1]
        logits_nV = logits_shard.reshape(-1, local_v)
        ids_n = target_ids.reshape(-1)
        rows, device = logits_nV.shape[0], logits_shard.device
        valid = local_v if vocab_size is None else max(0, min(local_v, vocab_size - vocab_start))
        local_ids = ids_n - vocab_start
        in_shard = (local_ids >= 0) & (local_ids < local_v)
        safe_ids = local_ids.clamp(0, max(valid, 1) - 1).unsqueeze(-1)
        # Per row, over this rank's valid columns, with m its own maximum of z = logits / T: m, then
        # sum exp(z - m), sum exp(z - m) * (z - m) and the target's z.
        local_max = torch.full((rows,), float("-inf"), device=device)
        sums = torch.zeros((3, rows), dtype=torch.float32, device=device)
        if valid:
            for c in _row_chunks(rows, valid):
                z = _scaled(logits_nV[c, :valid], temperature)
                m = z.max(dim=-1).values
                local_max[c] = m
                sums[2, c] = torch.gather(z, -1, safe_ids[c]).squeeze(-1)
                z.sub_(m.unsqueeze(-1))
                exp_z = z.exp()
                sums[0, c] = exp_z.sum(dim=-1)
                sums[1, c] = exp_z.mul_(z).sum(dim=-1)
        # a target in this rank's columns: its z (-inf in the padded ones), 0 elsewhere (the all-reduce's sum)
        sums[2] = torch.where(in_shard, sums[2].masked_fill(local_ids >= valid, float("-inf")), 0.0)
        z_max = local_max.clone()
        _all_reduce(z_max, dist.ReduceOp.MAX, group)
        # rescaled to the group's maximum M: sum exp(z - M) = a s, sum exp(z - M)(z - M) = a (e + (m - M) s)
        # with a = exp(m - M) (0 for a rank without valid columns, whose m is -inf)
        scale = (local_max - z_max).exp()
        shift = torch.where(sums[0] > 0, (local_max - z_max) * sums[0], 0.0)
        sums[1] = scale * (sums[1] + shift)
        sums[0] = scale * sums[0]
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, z_exp_z, target_z = sums[0], sums[1], sums[2]

        log_sum_exp = sum_exp.log()
        logp = (target_z - z_max) - log_sum_exp
        entropy = log_sum_exp - z_exp_z / sum_exp

        ctx.save_for_backward(logits_shard, z_max, sum_exp, safe_ids, in_shard & (local_ids < valid), entropy)
        ctx.temperature, ctx.valid = temperature, valid
        shape = target_ids.shape
        return logp.view(shape), entropy.view(shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        logits_shard, z_max, sum_exp, safe_ids, in_valid, entropy = ctx.saved_tensors
        local_v, valid, inv_t = logits_shard.shape[-1], ctx.valid, 1.0 / ctx.temperature
        logits_nV = logits_shard.reshape(-1, local_v)
        rows = logits_nV.shape[0]
        g_logp = torch.zeros(rows, device=z_max.device) if grad_logp is None else grad_logp.reshape(-1).float()
        grad_logits = torch.empty_like(logits_nV)
        if valid < local_v:
            grad_logits[:, valid:] = 0
        if not valid:
            return grad_logits.view(logits_shard.shape), None, None, None, None, None
        # With d = z - M (M the group's maximum), p = exp(d) / S and log p = d - log S:
        # d logp / d z_j = 1[j = target] - p_j;  d H / d z_j = -p_j (log p_j + H);  d z / d logits = 1 / T.
        # The per-row factors fold 1 / S and 1 / T in, so each chunk takes one pass per operation below.
        one_hot = (g_logp * in_valid * inv_t).unsqueeze(-1)
        if grad_entropy is None:
            coef = (-g_logp * inv_t / sum_exp).unsqueeze(-1)
        else:
            g_h = grad_entropy.reshape(-1).float()
            slope = -g_h * inv_t / sum_exp
            offset = (-(g_logp + g_h * (entropy - sum_exp.log())) * inv_t / sum_exp)
            slope, offset = slope.unsqueeze(-1), offset.unsqueeze(-1)
        for c in _row_chunks(rows, valid):
            d = _scaled(logits_nV[c, :valid], ctx.temperature).sub_(z_max[c].unsqueeze(-1))
            if grad_entropy is None:
                grad_z = d.exp_().mul_(coef[c])
            else:
                exp_d = d.exp()
                grad_z = d.mul_(slope[c]).add_(offset[c]).mul_(exp_d)
            grad_z.scatter_add_(-1, safe_ids[c], one_hot[c])
            grad_logits[c, :valid] = grad_z
        return grad_logits.view(logits_shard.shape), None, None, None, None, None


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def vocab_parallel_logprobs(
    logits_shard: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``target_ids`` and the entropy under ``softmax(logits / temperature)``.

    ``logits_shard`` holds this TP rank's contiguous vocabulary slice (rank r holds columns
    ``[r × V/tp, (r+1) × V/tp)``). ``vocab_size`` is the true vocabulary: padded columns at or
    beyond it are excluded from the softmax, so results equal the unpadded model's. Without
    ``tp_group`` (or with one rank) the logits are the whole vocabulary. Computed in fp32;
    differentiable with respect to ``logits_shard``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if target_ids.shape != logits_shard.shape[:-1]:
        raise ValueError(
            f"target_ids shape {tuple(target_ids.shape)} does not match logits {tuple(logits_shard.shape)} "
            "without its last (vocabulary) dimension"
        )
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    vocab_start = rank * logits_shard.shape[-1]
    return _VocabParallelLogProb.apply(logits_shard, target_ids, float(temperature), vocab_start, vocab_size, tp_group)
