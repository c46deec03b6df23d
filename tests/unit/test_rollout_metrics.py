"""A step's rollout metrics (finish reasons, multi-turn counters) and the failed-rollout limit."""

import pytest

from megarl.controller.metrics import RolloutFailureError, check_failed_rollouts, rollout_metrics
from megarl.data.batch import Batch


def _batch(reasons, errors=None, metrics=None):
    non_tensors = {"finish_reason": list(reasons)}
    if errors is not None:
        non_tensors["rollout_error"] = list(errors)
    if metrics is not None:
        non_tensors["metrics"] = list(metrics)
    return Batch(non_tensors=non_tensors)


def test_counters_are_summed_and_turns_averaged():
    batch = _batch(["stop", "abort", "stop", "length"], metrics=[
        {"num_tool_calls": 2.0, "num_timeouts/execute": 1.0, "num_assistant_turns": 3.0},
        {"failed": 1.0, "num_timeouts/create": 1.0, "num_assistant_turns": 0.0},
        {"num_tool_calls": 1.0, "num_assistant_turns": 2.0},
        {"num_assistant_turns": 1.0}])
    assert rollout_metrics(batch) == {
        "rollout/finish_abort_frac": 0.25, "rollout/finish_length_frac": 0.25, "rollout/finish_stop_frac": 0.5,
        "multi_turn/failed": 1.0, "multi_turn/num_tool_calls": 3.0, "multi_turn/num_timeouts/create": 1.0,
        "multi_turn/num_timeouts/execute": 1.0, "multi_turn/num_assistant_turns/mean": 1.5,
        "multi_turn/num_assistant_turns/max": 3.0}


def test_too_many_failed_rollouts_stop_the_run_naming_the_reasons():
    prompt = "the prompt has 401 tokens (tool schemas included), more than prompt_length=64"
    batch = _batch(["abort"] * 3 + ["stop"], errors=[prompt, prompt, "'calc' create timed out after 1 s", ""])
    with pytest.raises(RolloutFailureError) as error:
        check_failed_rollouts(batch, 0.5, "step 3")
    assert str(error.value) == (f"step 3: 3 of 4 rollouts failed, more than actor_rollout_ref.rollout.max_failed_frac"
                                f"=0.5. Reasons: 2x: {prompt}; 1x: 'calc' create timed out after 1 s")
    assert check_failed_rollouts(batch, 0.75, "step 3") == 3  # exactly at the limit: counted, not fatal
    assert check_failed_rollouts(_batch(["abort", "stop"]), 1.0, "step 1") == 1
    with pytest.raises(RolloutFailureError, match=r"2 of 2 rollouts failed.*2x: the engine aborted$"):
        check_failed_rollouts(_batch(["abort", "abort"]), 0.0, "validation")
    assert check_failed_rollouts(Batch(non_tensors={}), 0.0, "step 1") == 0
