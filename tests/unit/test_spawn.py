"""The rank harness returns results in rank order and never hides a failing or hung rank."""

import os
import time

import pytest

from megarl.parallel.launch import RankFailure, run_ranks


def _rank() -> int:
    return int(os.environ["RANK"])


def ok_job(x):
    return (_rank(), int(os.environ["WORLD_SIZE"]), x * 2, os.environ["OMP_NUM_THREADS"])


def raising_job():
    if _rank() == 1:
        raise ValueError("boom on purpose")
    time.sleep(60)  # the healthy rank would wait forever in a collective


def dying_job():
    if _rank() == 0:
        os._exit(3)
    time.sleep(60)


def exiting_job():
    raise SystemExit(0)


def hanging_job():
    time.sleep(60)


def test_results_come_back_in_rank_order():
    assert run_ranks(ok_job, 3, 21, timeout_s=60) == [(r, 3, 42, "1") for r in range(3)]


def test_failing_rank_traceback_is_reported_and_others_are_killed():
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 1 of 2 running raising_job failed.*ValueError: boom on purpose"):
        run_ranks(raising_job, 2, timeout_s=60)
    assert time.monotonic() - started < 30


def test_rank_that_dies_without_reporting_fails_the_job():
    with pytest.raises(RankFailure, match=r"rank 0 of 2 running dying_job died \(exit code 3\)"):
        run_ranks(dying_job, 2, timeout_s=60)


def test_system_exit_is_not_a_silent_pass():
    with pytest.raises(RankFailure, match="SystemExit"):
        run_ranks(exiting_job, 1, timeout_s=60)


def test_timeout_reports_the_stack_of_each_hung_rank():
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)ran past 3 s; ranks \[0, 1\].*rank 0 stack.*hanging_job"):
        run_ranks(hanging_job, 2, timeout_s=3)
    assert time.monotonic() - started < 20


def root_cause_job():
    if _rank() == 0:
        time.sleep(0.3)
        raise RuntimeError("[gloo] Connection closed by peer")  # what a peer's death looks like
    raise ValueError("the real problem")


def test_root_cause_is_reported_first_with_the_peer_symptoms_after():
    with pytest.raises(RankFailure) as info:
        run_ranks(root_cause_job, 2, timeout_s=60)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 running root_cause_job failed")
    assert "the real problem" in message and "--- rank 0 also failed ---" in message
