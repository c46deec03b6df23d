"""A reward model from an HF sequence-classification checkpoint: megarl's scores equal
transformers' at TP=2 and PP=2 (one 4-rank job, :mod:`tests.distributed.reward_model_jobs`)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import reward_model_jobs as jobs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen2ForSequenceClassification with one label (its ``score`` random), saved."""
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    from megarl.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("rm")
    causal = save_tiny(root / "causal", num_layers=4)
    config = AutoConfig.from_pretrained(causal)
    config.architectures = ["Qwen2ForSequenceClassification"]
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification.from_pretrained(causal, config=config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(root / "rm")
    return root / "rm", model.eval()


def test_reward_model_scores_equal_transformers_at_tp2_and_pp2(checkpoint):
    from megarl.parallel.launch import run_ranks

    directory, model = checkpoint
    batch = jobs.make_batch(model.config.vocab_size)
    mask = batch["attention_mask"]
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=mask,
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0].float()
    results = run_ranks(jobs.scores_job, 4, str(directory), batch, timeout_s=300)
    for layout in ("tp2", "pp2", "tp2_role", "pp2_role"):
        got = [r[layout] for r in results if layout in r]
        assert got, layout
        for scores in got:  # every last-stage rank of every replica
            torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert expected.abs().max() > 0.1  # the head is not near zero: the comparison means something
    assert batch["response_mask"].sum(-1).min() == 1  # a one-token response: its score is after its one token
