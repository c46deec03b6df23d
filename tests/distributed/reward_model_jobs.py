"""Rank-side job for the reward-model test: a sequence-classification checkpoint's scores at TP=2 and PP=2.

One 4-rank job builds the reward model (a critic-like :class:`ShardedModel` whose value head loads the checkpoint's
``score.weight``) at TP=2 (DP 2), then at PP=2 (DP 2), and returns each row's score: the value at its last response
token. The pytest process computes transformers' own scores (``Qwen2ForSequenceClassification``)."""

from __future__ import annotations

import torch

NUM_ROWS, PROMPT, RESPONSE = 6, 5, 5


def make_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts ‖ right-padded responses; ids >= 3 (0 is the pad id, which HF's pooling looks for)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(NUM_ROWS, PROMPT, dtype=torch.long)
    for row, pad in enumerate([0, 2, 1, 3, 0, 4]):
        prompt_mask[row, :pad] = 0
    response_mask = torch.ones(NUM_ROWS, RESPONSE, dtype=torch.long)
    for row, length in enumerate([5, 4, 1, 5, 3, 2]):
        response_mask[row, length:] = 0
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    ids = torch.randint(3, vocab_size, (NUM_ROWS, PROMPT + RESPONSE), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask.float()}


def last_response_token(batch) -> torch.Tensor:
    """Each row's position (in the whole sequence) of its last response token."""
    lengths = batch["response_mask"].sum(-1).long()
    return PROMPT + lengths - 1


def scores_job(hf_dir: str, batch: dict) -> dict:
    from megarl.config.algorithm import RewardConfig
    from megarl.data.batch import Batch
    from megarl.parallel import ParallelDims, destroy_parallel
    from megarl.workers.critic import RewardModelRole
    from megarl.workers.sharded_model import ShardedModel

    out = {}
    rows = Batch(tensors={**batch, "responses": batch["input_ids"][:, PROMPT:]})
    for name, dims in (("tp2", ParallelDims(tp=2)), ("pp2", ParallelDims(pp=2))):
        model = ShardedModel(hf_dir, dims, value_head=True, score_head=True)
        values = model.forward_values([{k: batch[k] for k in ("input_ids", "attention_mask")}])
        if values is not None:
            out[name] = values[0]["values"][torch.arange(NUM_ROWS), last_response_token(batch)].float()
        # The role the trainer calls, in micro-batches of 4 rows and 2 (response widths trimmed to each).
        role = RewardModelRole(model, RewardConfig(micro_batch_size_per_gpu=4))
        scores = role.compute_scores(rows)
        if scores is not None:
            out[f"{name}_role"] = scores["rm_scores"]
        destroy_parallel()
    return out
