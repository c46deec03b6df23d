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


def state_job(marker):
    import sys

    import torch

    return (os.getppid(), os.getpid(), "megatron.core" in sys.modules, "transformers" in sys.modules,
            torch.get_num_threads(), os.environ["MEGARL_WORKER_PROCESS"], os.environ.get("MEGARL_TEST_MARKER"),
            "wandb" in sys.modules and sys.modules["wandb"] is None, marker in os.environ)


def test_ranks_start_with_the_heavy_imports_done_and_are_new_processes_each_job():
    """Ranks fork from one server that has imported torch, Megatron-Core and transformers (PRELOAD) with the ranks'
    environment; each job's ranks are new processes; ``env`` reaches the ranks of any job."""
    first = run_ranks(state_job, 2, "MEGARL_TEST_MARKER", timeout_s=120)
    second = run_ranks(state_job, 2, "MEGARL_TEST_MARKER", timeout_s=120, env={"MEGARL_TEST_MARKER": "2"})
    servers = {row[0] for row in first + second}
    assert len(servers) == 1 and os.getpid() not in servers  # one forkserver, not this process
    assert len({row[1] for row in first + second}) == 4  # a new process per rank and job
    for row in first:
        assert row[2:] == (True, True, 1, "1", None, True, False)
    for row in second:
        assert row[2:] == (True, True, 1, "1", "2", True, True)
    assert "MEGARL_TEST_MARKER" not in os.environ


def test_results_come_back_in_rank_order():
    assert run_ranks(ok_job, 3, 21, timeout_s=60) == [(r, 3, 42, "1") for r in range(3)]


def test_failing_rank_traceback_is_reported_and_others_are_killed():
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 1 of 2 running raising_job failed.*ValueError: boom on purpose"):
        run_ranks(raising_job, 2, timeout_s=600)
    assert time.monotonic() - started < 300  # the other rank was killed, not waited out (it would take 600 s)


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
    assert time.monotonic() - started < 300  # the hung ranks were ended at their limit, not left running


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
