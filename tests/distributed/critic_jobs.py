"""Rank-side job for the critic tests: values vs HF, a layout-invariant update, learning, checkpoints.

One 4-rank job builds the critic at TP1 (DP4), then at TP2×PP2 (DP1), then loads the
TP2×PP2 checkpoint at TP1. The pytest process computes the reference values with HF
transformers (the head is deterministic: ``ValueHead`` seeded like the sharded model).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NUM_ROWS, PROMPT, RESPONSE = 8, 6, 6
SEED = 1234  # ShardedModel's default seed, which seeds the value head
CLIPRANGE = 0.2
LR = 3e-3
LEARN_CALLS = 3  # update() calls toward fixed returns (2 epochs × 2 mini-batches each)


def make_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts ‖ right-padded responses (one empty response row)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(NUM_ROWS, PROMPT, dtype=torch.long)
    for row, pad in enumerate([0, 2, 1, 3, 0, 4, 2, 1]):
        prompt_mask[row, :pad] = 0
    response_mask = torch.ones(NUM_ROWS, RESPONSE, dtype=torch.long)
    for row, length in enumerate([6, 4, 1, 6, 3, 5, 2, 6]):
        response_mask[row, length:] = 0
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    ids = torch.randint(3, vocab_size, (NUM_ROWS, PROMPT + RESPONSE), generator=gen) * mask
    # Outcome-like targets for the learning check: one return per row, on every response token.
    learn_returns = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, 0.0, -1.0, 0.5])[:, None].expand(NUM_ROWS, RESPONSE)
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, PROMPT:],
            "response_mask": response_mask.float(), "learn_returns": learn_returns.contiguous()}


def head_init(hidden_size: int, init_std: float) -> dict[str, torch.Tensor]:
    """The value head every sharded model starts from (seeded, layout-independent)."""
    from megarl.models.value_head import ValueHead

    head = ValueHead(hidden_size, init_std=init_std, seed=SEED)
    return {"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()}


def hf_values(model, batch, head) -> torch.Tensor:
    """[N, S] values by hand: HF's final-norm hidden state @ head weight + bias (positions from the mask)."""
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions,
                    output_hidden_states=True)
    return (out.hidden_states[-1].float() @ head["weight"].T + head["bias"]).squeeze(-1)


def _sharded(hf_dir, tp, pp, **kwargs):
    from megarl.parallel import ParallelDims
    from megarl.workers.sharded_model import ShardedModel

    return ShardedModel(hf_dir, ParallelDims(tp=tp, pp=pp), seed=SEED, value_head=True, **kwargs)


def _optim():
    from megarl.config import OptimConfig

    # eps = 1e-3 keeps Adam's first step well-conditioned for layout comparisons (see parity_jobs).
    return OptimConfig(lr=LR, eps=1e-3, clip_grad=1.0, weight_decay=0.01)


def _on_replica(sharded, value):
    """The output rank's ``value`` on every rank of its model replica (TP × PP)."""
    from megatron.core import parallel_state

    gathered = [None] * dist.get_world_size(parallel_state.get_model_parallel_group())
    dist.all_gather_object(gathered, value, group=parallel_state.get_model_parallel_group())
    return next(v for v in gathered if v is not None)


def _weights(sharded) -> dict[str, torch.Tensor]:
    """Full body weights (HF names, on every rank) and the head (on last-stage ranks)."""
    out = {n: t.clone() for bucket in sharded.exporter().iter_full(1 << 22) for n, t in bucket}
    head = _head(sharded)
    if head is not None:
        out.update({f"head.{k}": v for k, v in head.items()})
    return out


def _head(sharded) -> dict[str, torch.Tensor] | None:
    """This rank's value head (last stage only)."""
    if not sharded.groups.is_last_stage:
        return None
    head = sharded.module_chunks[-1].output_layer
    return {"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()}


def _vf_loss(values, batch) -> float:
    from megarl.algo.losses import value_loss

    loss, _ = value_loss(values, batch["values"], batch["returns"], batch["response_mask"], cliprange_value=None)
    return float(loss)


def _layout(hf_dir, batch, tp, pp, ckpt_dir=None) -> dict:
    """Values, one update (+ checkpoint save and learning at TP2×PP2) at one layout."""
    from megarl.config import CriticConfig
    from megarl.convert import save_dist_checkpoint
    from megarl.data.batch import Batch
    from megarl.workers.critic import CriticRole
    from megarl.workers.megatron_workers import step_metrics

    sharded = _sharded(hf_dir, tp, pp, optim=_optim())
    groups = sharded.groups
    mine = Batch(tensors=batch).shard(groups.dp_rank, groups.dims.dp)
    config = CriticConfig(ppo_mini_batch_size=NUM_ROWS, ppo_micro_batch_size_per_gpu=1,
                          forward_micro_batch_size_per_gpu=2, cliprange_value=CLIPRANGE)
    critic = CriticRole(sharded, config)
    full = sharded.forward_values([{k: mine[k][i:i + 3] for k in ("input_ids", "attention_mask")}
                                  for i in range(0, len(mine), 3)])
    out = {"rank": groups.rank, "dp_rank": groups.dp_rank, "output_rank": groups.is_collect_rank,
           "values_full": torch.cat([o["values"] for o in full]) if full is not None else None,
           "values": (critic.compute_values(mine) or {}).get("values"),
           "head_before": _head(sharded)}
    (step,) = critic.update(mine)
    out.update(applied=step.applied, loss=step.loss, grad_norm=step.grad_norm, lr=step.lr,
               metrics=step.metrics, named=step_metrics([step], "critic"), weights=_weights(sharded))
    if ckpt_dir is None:
        return out
    save_dist_checkpoint(sharded.chunks, ckpt_dir)
    values = critic.compute_values(mine)
    out["values_saved"] = None if values is None else values["values"]
    # Learning: fixed returns, old values refreshed before every update call.
    mine["returns"] = mine["learn_returns"]
    learn = CriticConfig(ppo_mini_batch_size=NUM_ROWS // 2, ppo_micro_batch_size_per_gpu=2, ppo_epochs=2,
                         cliprange_value=0.5, shuffle=True)
    critic = CriticRole(sharded, learn)
    losses, steps = [], []
    for call in range(LEARN_CALLS + 1):
        values = _on_replica(sharded, critic.compute_values(mine))["values"]
        mine["values"] = values
        losses.append(_vf_loss(values, mine))
        if call < LEARN_CALLS:
            steps += [(s.applied, s.loss) for s in critic.update(mine, seed=call)]
    out.update(learn_losses=losses, learn_steps=steps)
    return out


def _reload(hf_dir, ckpt_dir, batch) -> dict:
    """The TP2×PP2 checkpoint loaded into a fresh TP1 critic (random body: no HF weights)."""
    from megarl.config import CriticConfig
    from megarl.convert import load_dist_checkpoint
    from megarl.data.batch import Batch
    from megarl.workers.critic import CriticRole

    sharded = _sharded(hf_dir, 1, 1, load_weights=False)
    mine = Batch(tensors=batch).shard(sharded.groups.dp_rank, sharded.groups.dims.dp)
    before = _weights(sharded)
    load_dist_checkpoint(sharded.chunks, ckpt_dir)
    critic = CriticRole(sharded, CriticConfig(ppo_mini_batch_size=NUM_ROWS, forward_micro_batch_size_per_gpu=4))
    return {"dp_rank": sharded.groups.dp_rank, "before": before, "weights": _weights(sharded),
            "values": critic.compute_values(mine)["values"]}


def critic_job(hf_dir: str, batch: dict, ckpt_dir: str) -> dict:
    """TP1 (DP4), TP2×PP2 (DP1, saves ``ckpt_dir``), then the checkpoint reloaded at TP1."""
    return {
        (1, 1): _layout(hf_dir, dict(batch), 1, 1),
        (2, 2): _layout(hf_dir, dict(batch), 2, 2, ckpt_dir=ckpt_dir),
        "reload": _reload(hf_dir, ckpt_dir, dict(batch)),
    }
