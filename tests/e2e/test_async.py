"""Asynchronous training through Ray: generation overlaps training, engines on their own pool.

one_step_off: step k > 1 trains samples generated with the weights of step k - 2 (staleness exactly 1);
fully_async with partial rollouts: samples within the bound, requests held across syncs keep their tokens. Both
train the prompts a synchronous run trains, step by step (uids), and a resumed run continues with the same ones.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.test_train import ONE_RANK, _config, _run, assets  # noqa: F401  (the module fixture)

ASYNC = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.pool_nodes=[1]", *ONE_RANK]
"""The actor on one rank, one engine on a pool of its own."""


def _histograms(log_dir, tag: str) -> dict[int, tuple[float, float, float]]:
    """Step -> (min, max, count) of TensorBoard histogram ``tag`` in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"histograms": 0})
    events.Reload()
    return {event.step: (event.histogram_value.min, event.histogram_value.max, event.histogram_value.num)
            for event in events.Histograms(tag)}


DAPO = ["algorithm.filter_groups.enable=true", "reward_model.custom_reward_function.name=flat_on_even_prompts"]


@pytest.mark.parametrize("mode, extra", [
    ("one_step_off", []),
    ("fully_async", ["async_training.max_staleness=2", "async_training.partial_rollout=true",
                     "actor_rollout_ref.actor.tis_cap=2.0", *DAPO]),
])
def test_async_modes_train_the_synchronous_prompts_within_the_staleness_bound(assets, mode, extra):  # noqa: F811
    """Staleness within the bound at every step; fully_async with DAPO's filter: only groups with signal train."""
    import json

    dumps = assets["root"] / f"async_{mode}" / "dumps"
    trainer = _run(_config(assets, f"async_{mode}", "trainer.total_steps=3", f"trainer.mode={mode}",
                           f"trainer.rollout_data_dir={dumps}", *ASYNC, *extra))
    assert [s for s, _ in trainer.history] == [1, 2, 3]
    bound = 1 if mode == "one_step_off" else 2
    for step, metrics in trainer.history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"
        assert 0 <= metrics["async/staleness/min"] <= metrics["async/staleness/max"] <= bound
        assert metrics["actor/skipped_steps"] == 0 and metrics["weight_sync/engines"] == 1
        assert metrics["async/groups_dropped"] == 0
        assert 0 <= metrics["async/trainer_idle_frac"] <= 1 and 0 <= metrics["async/engine_idle_frac"] <= 1
        if mode == "one_step_off":  # step 1 generated with the first weights, every later one a version behind
            assert metrics["async/staleness/max"] == metrics["async/staleness/min"] == (0 if step == 1 else 1)
    rows = {step: [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
            for step in (1, 2, 3)}
    histograms = _histograms(trainer.log_dir, "async/staleness")
    assert sorted(histograms) == [1, 2, 3]
    for step, (low, high, count) in histograms.items():  # a TensorBoard histogram per step, over every sample
        assert count == 16 and 0 <= low <= high <= bound
    if mode == "one_step_off":
        assert trainer.loader.state_dict() == {"epoch": 0, "index": 3}
        for step in (1, 2, 3):  # each sample's weight versions (oldest, newest), as dumped
            assert {tuple(row["weight_versions"]) for row in rows[step]} == {(max(step - 2, 0),) * 2}
        return
    # Groups of even prompts score 0.5 on every sample: filtered (counted), odd ones take their places.
    filtered = trainer.history[-1][1]["async/groups_filtered"]
    assert filtered >= 1
    rows = [row for step in (1, 2, 3) for row in rows[step]]
    assert len(rows) == 3 * 4 * 4 and all(row["prompt_index"] % 2 == 1 for row in rows)
    assert trainer.loader.state_dict()["index"] >= 4  # more than 3 batches of prompts began


def test_a_resumed_async_run_trains_the_prompts_of_an_uninterrupted_one(assets):  # noqa: F811
    """Groups are consumed in prompt order: a run stopped after step 2 (checkpoint) and resumed trains at each step
    k the k-th batch of the prompt sequence (uid ``k-<row>``), as an uninterrupted run does (the first test): none
    lost, none repeated. The groups generated ahead when it stopped are kept in the checkpoint and trained as they
    were generated; those generating then are generated again with their seeds."""
    import json

    from megarl.rollout.buffer import GroupStatus, RolloutBuffer, load_state

    root = assets["root"]
    common = ["trainer.mode=fully_async", "async_training.max_staleness=2", "async_training.partial_rollout=true",
              *ASYNC]

    def dumped(step: int) -> list[dict]:
        path = root / "async_resume" / "dumps" / f"{step}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    dumps = f"trainer.rollout_data_dir={root / 'async_resume' / 'dumps'}"
    stopped = _run(_config(assets, "async_resume", "trainer.total_steps=2", "trainer.save_freq=2", dumps, *common))
    B = stopped.cfg.data.train_batch_size
    buffer = RolloutBuffer(groups_per_step=B, max_staleness=2)
    buffer.load_state_dict(*load_state(stopped.run_dir / "global_step_2" / "rollout_buffer"))
    saved = {}  # uid -> the responses generated before the stop
    for record in buffer.records.values():
        if record.status is GroupStatus.DONE:
            _, responses, _ = stopped._decode(record.batch)
            uid = record.batch["uid"][0]
            if int(uid.split("-")[0]) <= 4:  # groups of steps 3 and 4 (those of 5 and on are not trained)
                saved[uid] = sorted(responses)
    assert saved, "the stopped run generated ahead: its checkpoint holds groups of steps 3 and 4, not yet trained"
    resumed = _run(_config(assets, "async_resume", "trainer.total_steps=4", dumps, *common))
    assert [s for s, _ in resumed.history] == [3, 4]
    prompt_of = {}
    for step in (1, 2, 3, 4):
        rows = dumped(step)
        assert sorted({row["uid"] for row in rows}) == [f"{step}-{r}" for r in range(B)], step
        for row in rows:  # one prompt per uid, whichever run generated it
            assert prompt_of.setdefault(row["uid"], row["input"]) == row["input"]
    # The uid -> prompt map is the loader's: batch k's prompts, in order.
    for step in (1, 3):
        rows = resumed.loader.rows_of(step - 1)
        texts = resumed.tokenizer.batch_decode([resumed.train_set[i]["input_ids"] for i in rows],
                                               skip_special_tokens=True)
        assert [prompt_of[f"{step}-{r}"].strip() for r in range(B)] == [t.strip() for t in texts]
    trained = {}
    for step in (3, 4):
        for row in dumped(step):
            trained.setdefault(row["uid"], []).append(row["output"])
    assert {uid: sorted(trained[uid]) for uid in saved} == saved  # trained as generated before the stop
