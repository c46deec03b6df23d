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


def _shifted(logits_nV: torch.Tensor, temperature: float, padded: torch.Tensor | None,
             z_max_n: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``logits / temperature`` of some rows, padded columns at -inf, minus ``z_max_n`` when given."""
    z = logits_nV.float() / temperature
    if padded is not None:
        z = z.masked_fill(padded, float("-inf"))
    return z if z_max_n is None else z - z_max_n.unsqueeze(-1)


class _VocabParallelLogProb(torch.autograd.Function):
    """Rows are processed in chunks (:data:`CHUNK_ELEMENTS`); each row's numbers are those of the whole-tensor
    computation. The backward recomputes the probabilities from the logits (kept anyway) chunk by chunk instead of
    keeping an fp32 ``[T, V/tp]`` copy between forward and backward."""

    @staticmethod
    def forward(ctx, logits_shard, target_ids, temperature, vocab_start, vocab_size, group):
        local_v = logits_shard.shape[-1]
        logits_nV = logits_shard.reshape(-1, local_v)
        ids_n = target_ids.reshape(-1)
        padded = None
        if vocab_size is not None and vocab_start + local_v > vocab_size:
            columns = torch.arange(vocab_start, vocab_start + local_v, device=logits_shard.device)
            padded = columns >= vocab_size
        chunks = _row_chunks(logits_nV.shape[0], local_v)

        z_max = torch.cat([_shifted(logits_nV[c], temperature, padded, None).max(dim=-1).values for c in chunks])
        _all_reduce(z_max, dist.ReduceOp.MAX, group)

        local_ids = ids_n - vocab_start
        in_shard = (local_ids >= 0) & (local_ids < local_v)
        safe_ids = local_ids.clamp(0, local_v - 1).unsqueeze(-1)
        # Per row: sum of exp(z), the target's z and the expectation of z under p (as sum(exp(z) * z); padded
        # columns add 0), each a sum over this rank's columns, reduced over TP in one call.
        sums = torch.empty((3, logits_nV.shape[0]), dtype=torch.float32, device=logits_shard.device)
        for c in chunks:
            z = _shifted(logits_nV[c], temperature, padded, z_max[c])
            exp_z = z.exp()
            sums[0, c] = exp_z.sum(dim=-1)
            sums[1, c] = torch.gather(z, -1, safe_ids[c]).squeeze(-1).masked_fill(~in_shard[c], 0.0)
            sums[2, c] = (exp_z * z.masked_fill(padded, 0.0) if padded is not None else exp_z * z).sum(dim=-1)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, target_z, z_exp_z = sums[0], sums[1], sums[2]

        log_sum_exp = sum_exp.log()
        logp = target_z - log_sum_exp
        entropy = log_sum_exp - z_exp_z / sum_exp

        ctx.save_for_backward(logits_shard, z_max, sum_exp, safe_ids, in_shard, entropy, padded)
        ctx.temperature = temperature
        shape = target_ids.shape
        return logp.view(shape), entropy.view(shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits_shard, z_max, sum_exp, safe_ids, in_shard, entropy, padded = ctx.saved_tensors
        local_v = logits_shard.shape[-1]
        logits_nV = logits_shard.reshape(-1, local_v)
        grad_logp = grad_logp.reshape(-1)
        grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1)
        grad_logits = torch.empty_like(logits_nV)
        for c in _row_chunks(logits_nV.shape[0], local_v):
            probs = _shifted(logits_nV[c], ctx.temperature, padded, z_max[c]).exp_().div_(sum_exp[c].unsqueeze(-1))
            # d logp / d z_j = 1[j = target] - p_j
            grad_z = probs * (-grad_logp[c].unsqueeze(-1))
            one_hot_grad = (grad_logp[c] * in_shard[c]).unsqueeze(-1)
            grad_z.scatter_add_(-1, safe_ids[c], one_hot_grad)
            # d H / d z_j = -p_j (log p_j + H)
            if grad_entropy is not None:
                dh = torch.special.xlogy(probs, probs) + probs * entropy[c].unsqueeze(-1)
                grad_z -= dh * grad_entropy[c].unsqueeze(-1)
            grad_logits[c] = grad_z / ctx.temperature
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
