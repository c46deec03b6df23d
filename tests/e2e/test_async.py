"""Asynchronous training through Ray (issue 16): generation overlaps training, engines on their own pool.

one_step_off: step k > 1 trains samples generated with the weights of step k - 2 (staleness exactly 1);
fully_async with partial rollouts: samples within the bound, requests held across syncs keep their tokens. Both
train the prompts a synchronous run trains, step by step (uids), and a resumed run continues with the same ones.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.test_train import _config, _run, assets  # noqa: F401  (the module fixture)

ASYNC = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.pool_nodes=[2]"]


@pytest.mark.parametrize("mode, extra", [
    ("one_step_off", []),
    ("fully_async", ["async_training.max_staleness=2", "async_training.partial_rollout=true",
                     "actor_rollout_ref.actor.tis_cap=2.0"]),
])
def test_async_modes_train_the_synchronous_prompts_within_the_staleness_bound(assets, mode, extra):  # noqa: F811
    trainer = _run(_config(assets, f"async_{mode}", "trainer.total_steps=3", f"trainer.mode={mode}", *ASYNC, *extra))
    assert [s for s, _ in trainer.history] == [1, 2, 3]
    bound = 1 if mode == "one_step_off" else 2
    for step, metrics in trainer.history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"
        assert 0 <= metrics["async/staleness/min"] <= metrics["async/staleness/max"] <= bound
        assert metrics["actor/skipped_steps"] == 0 and metrics["weight_sync/verified_engines"] == 2
        assert metrics["async/groups_dropped"] == 0
        if mode == "one_step_off":  # step 1 generated with the first weights, every later one a version behind
            assert metrics["async/staleness/max"] == metrics["async/staleness/min"] == (0 if step == 1 else 1)
    assert trainer.loader.state_dict() == {"epoch": 0, "index": 3}
