"""Micro-batches of RL batches: row counts, token budgets, trimming of shared padding; PPO mini-batches."""

import pytest
import torch

from megarl.data.batch import Batch
from megarl.workers.micro import micro_batches, mini_batches, pad_responses, plan

P, R = 5, 4


def _batch(prompt_lengths, response_lengths):
    n = len(prompt_lengths)
    mask = torch.zeros(n, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        mask[i, P - p:P] = 1
        mask[i, P:P + r] = 1
    ids = torch.arange(n * (P + R)).view(n, P + R) * mask
    return Batch(tensors={"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:],
                          "response_mask": mask[:, P:], "advantages": torch.randn(n, R)})


def test_fixed_rows_are_trimmed_to_the_longest_prompt_and_response():
    batch = _batch([2, 3, 1, 5], [1, 2, 4, 1])
    assert plan(batch, size=2) == [(0, 2, 3, 2), (2, 4, 5, 4)]
    micro, widths = micro_batches(batch, ["input_ids", "attention_mask", "advantages"], size=2)
    assert widths == [2, 4]
    assert torch.equal(micro[0]["input_ids"], batch["input_ids"][:2, P - 3:P + 2])
    assert torch.equal(micro[0]["advantages"], batch["advantages"][:2, :2])
    # Only all-padding columns went: every token of every row is still there.
    assert int(micro[0]["attention_mask"].sum()) == int(batch["attention_mask"][:2].sum())


def test_token_budget_packs_rows_and_never_exceeds_it():
    batch = _batch([2, 2, 2, 2, 5, 1], [1, 1, 2, 1, 4, 1])
    parts = plan(batch, max_tokens=12)
    for start, end, p, r in parts:
        assert (end - start) * (p + r) <= 12 or end - start == 1
    assert parts[0] == (0, 3, 2, 2)  # 3 rows x 4 columns; a 4th row would need 16
    assert [s for s, *_ in parts] == sorted(s for s, *_ in parts) and parts[-1][1] == 6
    # A row longer than the budget goes alone.
    assert (4, 5, 5, 4) in plan(batch, max_tokens=6)


def test_interleaved_pipelines_get_a_multiple_of_pp_micro_batches():
    batch = _batch([2] * 6, [1] * 6)
    assert len(plan(batch, size=6)) == 1
    parts = plan(batch, size=6, multiple_of=2)
    assert len(parts) == 2 and parts[0][:2] == (0, 3) and parts[1][:2] == (3, 6)


def test_pad_responses_restores_the_full_width():
    out = pad_responses([torch.ones(2, 2), torch.full((1, 4), 2.0)], R)
    assert out.shape == (3, R)
    assert out[:2, 2:].abs().sum() == 0 and torch.equal(out[2], torch.full((4,), 2.0))


def test_packed_budget_counts_real_tokens_rounded_to_the_segment_alignment():
    # Rows of 3, 9, 2, 6 and 5 tokens. Padded, a micro-batch costs rows × its longest row; packed, its rows' tokens.
    batch = _batch([2, 5, 1, 4, 1], [1, 4, 1, 2, 4])
    assert plan(batch, max_tokens=12) == [(0, 1, 2, 1), (1, 2, 5, 4), (2, 4, 4, 2), (4, 5, 1, 4)]
    assert plan(batch, max_tokens=12, packed_align=1) == [(0, 2, 5, 4), (2, 4, 4, 2), (4, 5, 1, 4)]  # 3+9 fit
    parts = plan(batch, max_tokens=12, packed_align=4)  # 4, 12, 4, 8, 8 with each row rounded up to 4
    assert parts == [(0, 1, 2, 1), (1, 2, 5, 4), (2, 4, 4, 2), (4, 5, 1, 4)]
    lengths = (batch["attention_mask"].sum(-1) + 3) // 4 * 4
    for s, e, *_ in parts:
        assert e - s == 1 or int(lengths[s:e].sum()) <= 12
    # The budget is per GPU: a context-parallel split over 2 GPUs lets a pack hold twice as many tokens.
    assert plan(batch, max_tokens=12, packed_align=4, cp=2) == [(0, 3, 5, 4), (3, 5, 4, 4)]  # 20, then 16


def test_mini_batches_split_each_epoch_and_reshuffle_it_the_same_on_every_rank():
    batch = _batch([1, 2, 3, 4, 5, 1, 2, 3], [1, 2, 3, 4, 1, 2, 3, 4])
    first = lambda minis: [int(m["input_ids"][:, P:].sum()) for m in minis]  # noqa: E731
    # 16 trajectories per optimizer step over dp=4: 4 rows per mini-batch on this rank, 2 steps per epoch.
    kwargs = dict(role="actor", mini_batch_rows=16, dp=4, epochs=2, seed=3)
    plain = list(mini_batches(batch, shuffle=False, **kwargs))
    assert [len(m) for m in plain] == [4, 4, 4, 4]
    assert torch.equal(plain[0]["input_ids"], batch["input_ids"][:4]) and first(plain[:2]) == first(plain[2:])
    shuffled = list(mini_batches(batch, shuffle=True, **kwargs))
    rows = [sorted(int(i) for i in torch.cat([m["input_ids"][:, P] for m in shuffled[e:e + 2]])) for e in (0, 2)]
    assert rows[0] == rows[1] == sorted(int(i) for i in batch["input_ids"][:, P])  # each epoch: every row once
    assert first(shuffled) == first(mini_batches(batch, shuffle=True, **kwargs))  # the same order again
    assert first(shuffled) != first(mini_batches(batch, shuffle=True, **(kwargs | {"seed": 4})))


@pytest.mark.parametrize("rows, dp, message", [
    (6, 4, r"critic.ppo_mini_batch_size × rollout.n = 6 trajectories do not split over the critic's "
           r"data-parallel size 4"),
    (12, 2, r"8 rows on this DP rank do not split into mini-batches of 6 \(critic.ppo_mini_batch_size × rollout.n = "
            r"12 over dp=2\)"),
])
def test_mini_batches_refuse_a_batch_that_does_not_split(rows, dp, message):
    with pytest.raises(ValueError, match=message):
        next(mini_batches(_batch([1] * 8, [1] * 8), role="critic", mini_batch_rows=rows, dp=dp, epochs=1,
                          shuffle=False, seed=0))
