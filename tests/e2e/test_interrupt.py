"""Ctrl-C while ``ray.init`` runs (issue 12): the run exits cleanly (rc 130, one line, no traceback; it used to
segfault with rc 139) and no Ray process it started outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")


def _ray_pids() -> set[int]:
    """PIDs of Ray's processes on this machine (GCS, raylet, their agents, workers), engine servers and routers."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    marks = ("gcs_server", "raylet", "ray::", "ray/_private", "ray/dashboard", "default_worker.py",
             "megarl.rollout.server", "sglang_router")
    return {int(line.split(None, 1)[0]) for line in out.splitlines()
            if len(line.split(None, 1)) == 2 and any(m in line.split(None, 1)[1] for m in marks)}


def _start(tmp_path, *extra: str) -> subprocess.Popen:
    from megarl.models.tiny import save_tiny
    from megarl.warmstart.addition_data import ensure_addition_data

    train, test = ensure_addition_data(tmp_path / "data", num_train=16, num_test=4, seed=0)
    model = save_tiny(tmp_path / "model", num_layers=1)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "megarl.cli.train", "actor_rollout_ref.model.init=pretrained",
               f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
               f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'runs'}", *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _left_behind(before: set[int], timeout_s: float = 15.0) -> str:
    """``ps`` lines of Ray, engine server and router processes started since ``before`` still alive after
    ``timeout_s`` ('' when none)."""
    deadline = time.monotonic() + timeout_s
    while (left := _ray_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return ""
    return subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(map(str, left))], capture_output=True,
                          text=True).stdout


def _engine_urls(log_root) -> list[str]:
    """The URLs the run's engine servers serve on, from their logs ("serving <model> on http://host:port")."""
    import re

    urls = []
    for log in sorted(log_root.rglob("engine_*.log")):
        found = re.search(r"serving \S+ on (http://\S+)", log.read_text())
        if found:
            urls.append(found.group(1))
    return urls


def test_ctrl_c_during_training_stops_engine_servers_router_and_ray(tmp_path):
    """Issue 13: interrupted mid-run, no engine server, router or Ray process outlives megarl-train (by PID).
    The Ctrl-C lands while step 2's rollout is inside the engines: after step 1 the test pauses every engine in
    place and waits until a request waits or is held there (so the run is in its generation phase, on a
    machine of any speed)."""
    import asyncio

    from megarl.rollout.client import EngineClient
    from tests.engine_servers import load, wait_for

    before = _ray_pids()
    run = _start(tmp_path, "trainer.total_steps=20")
    output = []
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("step 1:") for line in output):
            line = run.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(output)[-3000:]
            output.append(line)
        servers = [pid for pid in _ray_pids() - before]
        assert servers  # the run's engine servers, router and Ray processes are up
        urls = _engine_urls(tmp_path / "runs")
        assert urls, list((tmp_path / "runs").rglob("*"))

        def busy(answer):
            entry = load(answer)
            return entry["num_running_reqs"] + entry["num_waiting_reqs"] > 0

        async def hold_the_rollout():
            for url in urls:
                engine = EngineClient(url)
                await engine.pause_generation("in_place")
                await engine.close()
            waits = [asyncio.ensure_future(wait_for(url, "/v1/loads", busy, "received a request")) for url in urls]
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in done:
                task.result()

        asyncio.run(hold_the_rollout())
        run.send_signal(signal.SIGINT)
        output.append(run.stdout.read())
        returncode = run.wait(timeout=60)
    finally:
        run.kill()
        run.wait()
    text = "".join(output)
    assert not (left := _left_behind(before)), left
    assert returncode == 130, text[text.find("Traceback") - 300:][:7000]
    assert "megarl-train: interrupted at step 1" in text


def test_ctrl_c_during_ray_init_exits_cleanly_and_leaves_no_process(tmp_path):
    from megarl.models.tiny import save_tiny
    from megarl.warmstart.addition_data import ensure_addition_data

    train, test = ensure_addition_data(tmp_path / "data", num_train=16, num_test=4, seed=0)
    model = save_tiny(tmp_path / "model", num_layers=1)
    before = _ray_pids()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "megarl.cli.train", "actor_rollout_ref.model.init=pretrained",
               f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
               f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'runs'}"]
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    output = []
    try:
        deadline = time.monotonic() + 120
        while not any("starting a local Ray cluster" in line for line in output):
            line = run.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(output)[-3000:]
            output.append(line)
        # The line is printed inside the block that holds interrupts until ray.init is done (where an interrupt
        # used to orphan Ray's agents): Ctrl-C now lands there on a machine of any speed, as the message below
        # ("stopping once Ray has started is done") confirms.
        run.send_signal(signal.SIGINT)
        start = time.monotonic()
        output.append(run.stdout.read())
        returncode = run.wait(timeout=60)
        stopped_s = time.monotonic() - start
    finally:
        run.kill()
        run.wait()
    text = "".join(output)
    deadline = time.monotonic() + 15
    while (left := _ray_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(map(str, left))], capture_output=True,
                                    text=True).stdout
    assert returncode == 130, text[text.find("Traceback") - 300:][:7000]
    assert "interrupt: stopping once Ray has started is done" in text
    assert "megarl-train: interrupted at step 0; workers and Ray stopped" in text
    assert "Traceback" not in text and "Segmentation fault" not in text
    assert stopped_s < 30
