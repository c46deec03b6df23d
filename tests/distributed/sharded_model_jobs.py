"""Rank-side job for the sharded model tests: log-probs vs HF, and one PPO step at three layouts."""

from __future__ import annotations

import torch

NUM_ROWS, SEQ = 4, 12
LAYOUTS = [(1, 1, True), (2, 2, True), (2, 2, False)]
"""(tp, pp, packed) on 4 ranks: DP=4, then TP=2 × PP=2 × DP=1, packed (THD) and padded."""


def make_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts followed by right-padded responses, plus RL per-token fields."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (NUM_ROWS, SEQ), generator=gen)
    mask = torch.ones(NUM_ROWS, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -4:] = 0
    mask[2, :1] = 0
    mask[2, -2:] = 0
    ids[mask == 0] = 0
    # Loss on "response" positions 5.. whose next token is real: position t scores token t+1.
    loss_mask = torch.zeros(NUM_ROWS, SEQ)
    loss_mask[:, 5:-1] = (mask[:, 6:] == 1).float()
    return {
        "input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
        "advantages": torch.randn(NUM_ROWS, 1, generator=gen).expand(NUM_ROWS, SEQ).contiguous(),
        "old_logp_shift": torch.randn(NUM_ROWS, SEQ, generator=gen) * 0.05,
    }


def scored_positions(batch) -> torch.Tensor:
    """``[N, S]`` bool: the positions whose next token is real (where a log-prob is compared)."""
    valid = batch["attention_mask"].bool().clone()
    valid[:, :-1] &= batch["attention_mask"][:, 1:].bool()
    valid[:, -1] = False
    return valid


def hf_logprobs(model, batch) -> torch.Tensor:
    """log p(token t+1 | ≤ t) from HF transformers with positions from the attention mask."""
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions).logits
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.cat([logp, torch.zeros(NUM_ROWS, 1)], dim=1)


def tiny_reference(directory) -> tuple[str, dict, torch.Tensor]:
    """A tiny Qwen2 saved under ``directory``, the test batch for it, and HF transformers' log-probs of the batch."""
    from transformers import AutoModelForCausalLM

    from megarl.models.tiny import save_tiny

    hf_dir = save_tiny(directory / "model", num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    batch = make_batch(model.config.vocab_size)
    return str(hf_dir), batch, hf_logprobs(model, batch)


def _rows(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


def sharded_model_job(hf_dir: str, batch: dict, layouts=tuple(LAYOUTS)) -> dict:
    from megarl.algo.losses import agg_norm, policy_loss
    from megarl.config import OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel

    global_norm = agg_norm(batch["loss_mask"], "token-mean")
    out = {}
    for tp, pp, packed in layouts:
        sharded = ShardedModel(hf_dir, ParallelDims(tp=tp, pp=pp), optim=OptimConfig(lr=1e-3, eps=1e-3, clip_grad=1.0),
                               packed=packed)
        groups = sharded.groups
        micro = [_rows(batch, slice(i, i + 2)) for i in range(0, NUM_ROWS, 2)]
        fwd = sharded.forward_logprobs(micro, temperature=1.0)
        logp = torch.cat([o["logp"] for o in fwd]) if fwd is not None else None
        old_logp = (logp if logp is not None else torch.zeros(NUM_ROWS, SEQ)) + batch["old_logp_shift"]
        if pp > 1:  # the last stage owns the log-probs; the loss needs them on the last stage only
            torch.distributed.broadcast(old_logp, src=torch.distributed.get_global_rank(groups.pp, pp - 1),
                                        group=groups.pp)

        def loss_fn(logp_BS, entropy_BS, mb):
            return policy_loss(logp_BS, mb["old_logp"], mb["advantages"], mb["loss_mask"],
                               loss_agg_mode="token-mean", global_norm=global_norm,
                               entropy_BT=entropy_BS, entropy_coeff=0.01)

        rows = [{**_rows(batch, slice(i, i + 1)), "old_logp": old_logp[i : i + 1]} for i in range(NUM_ROWS)]
        mine = rows[groups.dp_rank :: groups.dims.dp]
        step = sharded.train_step(mine, loss_fn)
        weights = {n: t.clone() for b in sharded.exporter().iter_full(1 << 22) for n, t in b}

        def nan_loss(logp_BS, entropy_BS, mb):
            return logp_BS.sum() * float("nan"), {}

        skipped = sharded.train_step(mine, nan_loss)
        after_nan = {n: t.clone() for b in sharded.exporter().iter_full(1 << 22) for n, t in b}
        out[(tp, pp, packed)] = {
            "logp": logp, "loss": step.loss, "grad_norm": step.grad_norm, "applied": step.applied,
            "lr": step.lr, "metrics": step.metrics, "weights": weights if groups.rank == 0 else None,
            "nan_applied": skipped.applied,
            "nan_unchanged": all(torch.equal(weights[n], after_nan[n]) for n in weights),
        }
    return out
