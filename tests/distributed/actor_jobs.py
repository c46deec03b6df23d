"""Rank-side job: the Megatron actor recomputes the HF engine's rollout log-probs and learns."""

from __future__ import annotations

import contextlib

import torch


def rollout_batch(hf_dir: str, *, n: int = 4, temperature: float = 0.8, log_dir: str | None = None):
    """Addition prompts rolled out by a CPU engine server (seed 3; its log in ``log_dir``, else a temporary
    directory), with GRPO advantages from a fake reward."""
    import tempfile

    from transformers import AutoTokenizer

    from megarl.config import RolloutConfig
    from megarl.data.dataset import collate
    from megarl.rollout import RolloutManager
    from tests.engine_servers import engine_servers

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    rows = []
    for i, (a, b) in enumerate([(12, 30), (45, 17), (60, 21), (33, 48)]):
        messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        rows.append({"input_ids": torch.tensor(ids), "index": i})
    prompts = collate(rows, pad_token_id=tokenizer.pad_token_id, pad_to=24)
    config = RolloutConfig(n=n, temperature=temperature, seed=3)
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout_batch_"))
        servers = stack.enter_context(engine_servers(hf_dir, log_dir, num_engines=1, seeds=[3]))
        batch = RolloutManager(servers.generator, servers.engines, tokenizer, config, prompt_length=24,
                               response_length=10).generate(prompts)
    return fake_grpo(batch, prompts=4, n=n)


def fake_grpo(batch, *, prompts: int, n: int):
    """``batch`` (``prompts`` × ``n`` rollouts) with GRPO advantages from a fake outcome reward: 1 when the first
    response token id is even."""
    import numpy as np

    from megarl.algo.advantages import compute

    batch["uid"] = np.repeat(np.arange(prompts), n).astype(object)
    scores = torch.zeros_like(batch["rollout_log_probs"])
    lengths = batch["response_mask"].sum(-1)
    scores[torch.arange(len(lengths)), (lengths - 1).clamp(min=0)] = (batch["responses"][:, 0] % 2 == 0).float()
    batch["token_level_rewards"] = scores
    compute("grpo", batch)
    return batch


def actor_job(hf_dir: str, batch, temperature: float) -> dict:
    from megarl.algo.mismatch import mismatch_metrics
    from megarl.config import ActorConfig, OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.actor import ActorRole
    from megarl.workers.sharded_model import ShardedModel

    sharded = ShardedModel(hf_dir, ParallelDims(tp=2, pp=2), optim=OptimConfig(lr=2e-3, clip_grad=1.0))
    actor = ActorRole(sharded, ActorConfig(ppo_mini_batch_size=len(batch) // 2, ppo_micro_batch_size_per_gpu=2,
                                          ppo_epochs=2, entropy_coeff=0.0))
    before = actor.compute_log_prob(batch, temperature=temperature)
    old = before["log_probs"] if before is not None else torch.zeros_like(batch["rollout_log_probs"])
    src = torch.distributed.get_global_rank(sharded.groups.pp, sharded.groups.dims.pp - 1)
    torch.distributed.broadcast(old, src=src, group=sharded.groups.pp)  # old_log_probs on every stage
    batch["old_log_probs"] = old
    steps = actor.update(batch, temperature=temperature)
    after = actor.compute_log_prob(batch, temperature=temperature)
    if before is None:
        return {"output_rank": False, "steps": [(s.applied, s.loss, s.grad_norm) for s in steps]}
    mask = batch["response_mask"].float()
    moved = ((after["log_probs"] - before["log_probs"]) * batch["advantages"].sign() * mask).sum() / mask.sum()
    return {
        "output_rank": True,
        "mismatch": mismatch_metrics(batch["rollout_log_probs"], before["log_probs"], mask),
        "steps": [(s.applied, s.loss, s.grad_norm) for s in steps],
        "moved_toward_advantage": float(moved),
    }
