"""The rollout buffer of asynchronous training (megarl.rollout.buffer): order, admission, staleness, DAPO, resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.data.batch import Batch
from megarl.rollout.buffer import GroupStatus, RolloutBuffer, load_state, save_state

N, R = 4, 3  # samples per group, response tokens


def group(index: int, *, version: int | None = 0, rewards=(0.0, 1.0, 0.0, 1.0)) -> Batch:
    tensors = {"token_level_scores": torch.tensor(rewards)[:, None].expand(N, R).contiguous() / R,
               "responses": torch.full((N, R), index)}
    if version is not None:
        tensors["rollout_weight_versions"] = torch.tensor([[version, version, -1]] * N)
    return Batch(tensors=tensors, non_tensors={"uid": np.array([f"g{index}"] * N, dtype=object),
                                               "reward_model": [{"ground_truth": np.int64(index)}] * N,
                                               "turns": np.arange(N) + index})


def issue(buffer: RolloutBuffer, version: int, cap: int = 100) -> list[int]:
    return [buffer.issue_next().index for _ in range(buffer.capacity(version, cap))]


def indices(taken) -> list[int]:
    return [r.index for r in taken[0]]


def test_steps_take_whole_groups_in_prompt_order_and_wait_for_the_head():
    buffer = RolloutBuffer(groups_per_step=2, max_staleness=1)
    assert issue(buffer, 0) == [0, 1, 2, 3]  # (v + s + 1) · B = 4 groups ahead at version 0
    for index in (3, 1, 2):  # completions out of order
        buffer.completed(index, 0, group(index))
    assert buffer.take(1) is None  # group 0 still generates
    buffer.completed(0, 0, group(0))
    assert indices(buffer.take(1)) == [0, 1]
    assert indices(buffer.take(2)) == [2, 3]
    assert buffer.take(3) is None and buffer.consumed_head == 4
    assert issue(buffer, 1) == [4, 5]  # version 1: up to rank 6


def test_admission_counts_kept_or_pending_groups_and_the_inflight_cap():
    buffer = RolloutBuffer(groups_per_step=2, max_staleness=0, filter_metric="seq_reward")
    assert buffer.capacity(0, 100) == 2  # on-policy: one step ahead
    assert issue(buffer, 0, cap=1) == [0]  # at most one generating
    assert buffer.capacity(0, 1) == 0 and buffer.capacity(0, 100) == 1
    issue(buffer, 0)
    assert buffer.capacity(0, 100) == 0
    # A filtered group (all rewards equal) frees its place.
    assert buffer.completed(0, 0, group(0, rewards=(1.0,) * N)) is GroupStatus.FILTERED
    assert buffer.capacity(0, 100) == 1 and buffer.counts["filtered"] == 1
    assert issue(buffer, 0) == [2]
    for index in (1, 2):
        buffer.completed(index, 0, group(index))
    assert indices(buffer.take(1)) == [1, 2]  # the filtered group is passed over
    assert buffer.capacity(1, 100) == 2  # version 1: ranks up to (1 + 0 + 1) · 2 = 4; kept or pending: 2


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_a_group_past_the_bound_is_dropped_or_regenerated(policy):
    buffer = RolloutBuffer(groups_per_step=1, max_staleness=1, stale_policy=policy)
    issue(buffer, 0)
    buffer.completed(0, 0, group(0, version=0))
    buffer.completed(1, 0, group(1, version=2))
    # Step 4 trains with version 3: group 0's tokens (version 0) are 3 versions old, over the bound of 1.
    out = buffer.take(4)
    if policy == "drop":
        assert indices(out) == [1] and buffer.counts["dropped"] == 1
    else:
        taken, again = out
        assert taken == [] and [(r.index, r.attempt) for r in again] == [(0, 1)]
        assert buffer.take(4) is None  # waits for the regenerated group
        buffer.completed(0, 0, group(0, version=3))  # the first attempt's late answer is ignored
        assert buffer.records[0].status is GroupStatus.ISSUED
        buffer.completed(0, 1, group(0, version=3))
        assert indices(buffer.take(4)) == [0] and buffer.counts["regenerated"] == 1
    assert all(buffer.staleness(r, 4) <= 1 for r in buffer.records.values() if r.status is GroupStatus.CONSUMED)


def test_filtering_gives_up_after_max_num_gen_batches():
    buffer = RolloutBuffer(groups_per_step=2, max_staleness=3, filter_metric="seq_reward", max_filtered_batches=1)
    issue(buffer, 0)
    for index in range(3):
        buffer.completed(index, 0, group(index, rewards=(0.5,) * N))
    with pytest.raises(RuntimeError, match="3 groups in a row were filtered or dropped, more than "
                                           r"algorithm.filter_groups.max_num_gen_batches=1 batches of 2"):
        buffer.take(1)


def test_a_restored_buffer_takes_the_same_groups_and_reissues_the_generating_ones(tmp_path):
    def run(restore_after: int | None):
        buffer = RolloutBuffer(groups_per_step=2, max_staleness=1)
        issue(buffer, 0)
        for index in (0, 1, 3):
            buffer.completed(index, 0, group(index))
        taken = [indices(buffer.take(1))]
        again = []
        if restore_after is not None:
            save_state(tmp_path / "buffer", buffer.state_dict())
            buffer = RolloutBuffer(groups_per_step=2, max_staleness=1)
            again = [(r.index, r.attempt) for r in buffer.load_state_dict(*load_state(tmp_path / "buffer"))]
            with pytest.raises(ValueError, match="steps of 2 prompts, the run has data.train_batch_size=3"):
                RolloutBuffer(groups_per_step=3, max_staleness=1).load_state_dict(*load_state(tmp_path / "buffer"))
        buffer.completed(2, 0, group(2))
        out = buffer.take(2)
        taken.append(indices(out))
        restored = out[0][1].batch  # group 3: done at the save, restored from the files
        assert restored["turns"].dtype == np.int64 and restored["turns"].tolist() == [3, 4, 5, 6]
        assert restored["reward_model"][0] == {"ground_truth": 3}
        assert torch.equal(restored["rollout_weight_versions"], group(3)["rollout_weight_versions"])
        return taken, again, [r.batch["responses"][0, 0].item() for r in out[0]]

    assert run(None)[0] == run(1)[0] == [[0, 1], [2, 3]]
    assert run(1)[1] == [(2, 0)]  # group 2 was generating at the save: issued again, same attempt (same seeds)
    assert run(1)[2] == [2, 3]
