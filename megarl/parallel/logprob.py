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


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, target_ids, temperature, vocab_start, vocab_size, group):
        z = logits_shard.float() / temperature
        local_v = z.shape[-1]
        padded = None
        if vocab_size is not None and vocab_start + local_v > vocab_size:
            columns = torch.arange(vocab_start, vocab_start + local_v, device=z.device)
            padded = columns >= vocab_size
            z = z.masked_fill(padded, float("-inf"))

        z_max = z.max(dim=-1).values
        _all_reduce(z_max, dist.ReduceOp.MAX, group)
        z = z - z_max.unsqueeze(-1)
        exp_z = z.exp()
        sum_exp = exp_z.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)

        local_ids = target_ids - vocab_start
        in_shard = (local_ids >= 0) & (local_ids < local_v)
        safe_ids = local_ids.clamp(0, local_v - 1).unsqueeze(-1)
        target_z = torch.gather(z, -1, safe_ids).squeeze(-1).masked_fill(~in_shard, 0.0)
        # Expectation of z under p, accumulated as sum(exp(z) * z); padded columns add 0.
        z_exp_z = (exp_z * z.masked_fill(padded, 0.0) if padded is not None else exp_z * z).sum(dim=-1)
        reduced = torch.stack([target_z, z_exp_z])
        _all_reduce(reduced, dist.ReduceOp.SUM, group)
        target_z, z_exp_z = reduced[0], reduced[1]

        log_sum_exp = sum_exp.log()
        logp = target_z - log_sum_exp
        entropy = log_sum_exp - z_exp_z / sum_exp

        probs = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, safe_ids, in_shard, entropy)
        ctx.temperature = temperature
        ctx.logits_dtype = logits_shard.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        probs, safe_ids, in_shard, entropy = ctx.saved_tensors
        # d logp / d z_j = 1[j = target] - p_j
        grad_z = probs * (-grad_logp.unsqueeze(-1))
        one_hot_grad = (grad_logp * in_shard).unsqueeze(-1)
        grad_z.scatter_add_(-1, safe_ids, one_hot_grad)
        # d H / d z_j = -p_j (log p_j + H)
        if grad_entropy is not None:
            dh = torch.special.xlogy(probs, probs) + probs * entropy.unsqueeze(-1)
            grad_z -= dh * grad_entropy.unsqueeze(-1)
        grad_logits = (grad_z / ctx.temperature).to(ctx.logits_dtype)
        return grad_logits, None, None, None, None, None


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
