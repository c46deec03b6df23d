"""Ctrl-C while ``ray.init`` runs: the run exits cleanly (rc 130, one line, no traceback; it used to
segfault with rc 139) and no Ray process it started outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("ray")


TAG = "MEGARL_TEST_RUN"
"""Set to a fresh value in each run's environment: every process the run starts (Ray's GCS, raylet, agents and
workers, engine servers, the router) inherits it, so the test finds exactly its own run's processes, whatever
else runs on the machine (another test's Ray cluster, a CI job beside it)."""


def _run_pids(tag: str) -> set[int]:
    """Live processes started by the run tagged ``tag`` (``/proc/<pid>/environ``; zombies have none), and their
    descendants (Ray's agents write their process titles over their environments)."""
    import psutil

    mark = f"{TAG}={tag}".encode()
    pids = set()
    for proc in os.listdir("/proc"):
        if proc.isdigit():
            try:
                with open(f"/proc/{proc}/environ", "rb") as environ:
                    if mark in environ.read().split(b"\0"):
                        pids.add(int(proc))
            except OSError:  # gone, or not ours
                continue
    for pid in list(pids):
        try:
            pids |= {child.pid for child in psutil.Process(pid).children(recursive=True)
                     if child.status() != psutil.STATUS_ZOMBIE}
        except psutil.NoSuchProcess:
            continue
    return pids


def _environ(pid: int) -> dict[str, str]:
    """A process's initial environment (empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except OSError:
        return {}
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _start(tmp_path, tag: str, *extra: str) -> subprocess.Popen:
    from megarl.models.tiny import save_tiny
    from megarl.warmstart.addition_data import ensure_addition_data

    train, test = ensure_addition_data(tmp_path / "data", num_train=16, num_test=4, seed=0)
    model = save_tiny(tmp_path / "model", num_layers=1)
    # As a user runs it: no RAY_AUTH_MODE, so the run's local Ray cluster uses token authentication.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", TAG: tag}
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    command = [sys.executable, "-m", "megarl.cli.train", "recipe=tiny_cpu_grpo",
               "actor_rollout_ref.model.init=pretrained",
               f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{test}]",
               f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.log_dir={tmp_path / 'runs'}",
               # the recipe's layout (TP=2, two engines), an eighth of its rollouts: the subject is the processes
               "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "data.max_response_length=8",
               "actor_rollout_ref.actor.ppo_mini_batch_size=4", *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


HANG_S = 1200.0
"""How long a test waits for a line the run will print (its start, its first step): a guard against a hung run,
never a measure of speed. A run that fails ends itself, which ends the wait at once; on two busy cores the tiny
run's start took five minutes."""


STOP_S = 300.0
"""How long a test waits for a signalled run to end (its orderly shutdown): a guard against a hung shutdown."""


def _read_until(run: subprocess.Popen, output: list[str], wanted, timeout_s: float = HANG_S) -> None:
    """Read the run's output lines into ``output`` until one satisfies ``wanted`` (fails on its end or after
    ``timeout_s``, showing the output's tail)."""
    deadline = time.monotonic() + timeout_s
    while not any(wanted(line) for line in output):
        line = run.stdout.readline()
        assert line and time.monotonic() < deadline, "".join(output)[-3000:]
        output.append(line)


def _left_behind(tag: str, timeout_s: float = 15.0) -> str:
    """``ps`` lines of the processes the run tagged ``tag`` started that are still alive after ``timeout_s`` ('' when
    none)."""
    deadline = time.monotonic() + timeout_s
    while (left := _run_pids(tag)) and time.monotonic() < deadline:
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


def test_sigterm_during_training_stops_engine_servers_router_and_ray(tmp_path):
    """Interrupted mid-run, no engine server, router or Ray process outlives megarl-train (by PID).
    The signal is SIGTERM (what kill, scancel and docker stop send; it used to end the driver with SIGABRT and Ray's
    C++ stack, no line of megarl's): stopped as a Ctrl-C is (the same path: ``Terminated`` is a
    ``KeyboardInterrupt``), rc 143 and one line. It lands while a step's rollout is inside the engines: after step 1
    the test pauses every engine in place and waits until a request waits or is held there (so the run is in its generation phase, on a
    machine of any speed). That is step 2's rollout, or on a fast machine a later one's (step 2 may have
    generated before the pause arrived): the message names the last step the run printed."""
    import asyncio

    from megarl.engines.client import EngineClient
    from tests.engine_servers import admin_key_of, load, wait_for

    tag = uuid.uuid4().hex
    run = _start(tmp_path, tag, "trainer.total_steps=20")
    output = []
    try:
        _read_until(run, output, lambda line: line.startswith("step 1:"))
        started = _run_pids(tag) - {run.pid}
        assert len(started) > 3  # the run's engine servers, router and Ray processes are up (tagged)
        # The run's own Ray cluster authenticates with a token of its own (only its processes hold it).
        # (Ray's GCS and raylet: processes forked without exec show the driver's environment as it was at its start.)
        ray_servers = [pid for pid in started if any(name in _cmdline(pid) for name in ("gcs_server", "raylet"))]
        environs = [_environ(pid) for pid in ray_servers]
        assert len(environs) >= 2 and {environ.get("RAY_AUTH_MODE") for environ in environs} == {"token"}
        assert all(len(environ.get("RAY_AUTH_TOKEN", "")) == 64 for environ in environs)
        urls = _engine_urls(tmp_path / "runs")
        assert urls, list((tmp_path / "runs").rglob("*"))
        # On one machine nothing of the run listens beyond loopback: Ray's servers, workers and agents,
        # the training ranks, the engine servers and the router.
        import psutil

        listening = {}
        for pid in started | {run.pid}:
            try:
                for connection in psutil.Process(pid).net_connections("tcp"):
                    if connection.status == psutil.CONN_LISTEN:
                        listening[(connection.laddr.ip, connection.laddr.port)] = _cmdline(pid)[:80]
            except psutil.NoSuchProcess:
                continue
        assert len(listening) > 5, listening
        wide = {address: name for address, name in listening.items()
                if address[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")}
        assert not wide, wide

        def busy(answer):
            entry = load(answer)
            return entry["num_running_reqs"] + entry["num_waiting_reqs"] > 0

        async def hold_the_rollout():
            for url in urls:  # the run's engines serve control routes to holders of its key only
                engine = EngineClient(url, admin_key=admin_key_of(url))
                await engine.pause_generation("in_place")
                await engine.close()
            waits = [asyncio.ensure_future(wait_for(url, "/v1/loads", busy, "received a request")) for url in urls]
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in done:
                task.result()

        asyncio.run(hold_the_rollout())
        run.send_signal(signal.SIGTERM)
        output.append(run.stdout.read())
        returncode = run.wait(timeout=STOP_S)
    finally:
        run.kill()
        run.wait()
    text = "".join(output)
    assert not (left := _left_behind(tag)), left
    assert returncode == 143, text[text.find("Traceback") - 300:][:7000]
    import re

    lines = sorted({int(k) for k in re.findall(r"^step (\d+):", text, flags=re.MULTILINE)})  # step 0: validation
    assert lines == list(range(lines[-1] + 1)) and lines[-1] >= 1, text[-3000:]
    assert f"megarl-train: terminated (SIGTERM) at step {lines[-1]};" in text, text[-3000:]
    assert "Traceback" not in text and "SIGABRT" not in text and "*** " not in text, text[-3000:]


def test_ctrl_c_during_ray_init_exits_cleanly_and_leaves_no_process(tmp_path):
    tag = uuid.uuid4().hex
    run = _start(tmp_path, tag)
    output = []
    try:
        _read_until(run, output, lambda line: "starting a local Ray cluster" in line)
        # The line is printed inside the block that holds interrupts until ray.init is done (where an interrupt
        # used to orphan Ray's agents): Ctrl-C now lands there on a machine of any speed, as the message below
        # ("stopping once Ray has started is done") confirms.
        run.send_signal(signal.SIGINT)
        output.append(run.stdout.read())
        returncode = run.wait(timeout=STOP_S)
    finally:
        run.kill()
        run.wait()
    text = "".join(output)
    assert not (left := _left_behind(tag)), left
    assert returncode == 130, text[text.find("Traceback") - 300:][:7000]
    assert "interrupt: stopping once Ray has started is done" in text
    assert "megarl-train: interrupted at step 0; workers and Ray stopped" in text
    assert "Traceback" not in text and "Segmentation fault" not in text


def test_a_killed_driver_leaves_no_process_and_no_shared_memory(tmp_path):
    """``kill -9`` of megarl-train once the weight sync's shared-memory buffers exist (after step 1):
    within 30 s no process of the run is left (Ray's dashboard and runtime-env agents used to outlive the driver by
    about a minute, still listening) and none of its ``/dev/shm/torch_<pid>_*`` files (they used to stay until the
    next run's start)."""
    from pathlib import Path

    tag = uuid.uuid4().hex
    run = _start(tmp_path, tag, "trainer.total_steps=20")
    output = []
    try:
        _read_until(run, output, lambda line: line.startswith("step 1:"))
        started = _run_pids(tag) - {run.pid}
        import psutil

        born = {}  # pid -> start time of the run's processes
        for pid in started:
            try:
                born[pid] = psutil.Process(pid).create_time()
            except psutil.NoSuchProcess:
                continue

        def shared_memory() -> list[Path]:
            return [path for pid in started for path in Path("/dev/shm").glob(f"torch_{pid}_*")]

        held = shared_memory()
        assert held, "the tensor transport's bucket buffers exist after step 1's weight sync"
        import tempfile

        from megarl.parallel.reaper import RENDEZVOUS_PREFIX, RUN_ID_VARIABLE

        run_id = next(env[RUN_ID_VARIABLE] for env in map(_environ, started) if RUN_ID_VARIABLE in env)
        rendezvous = list(Path(tempfile.gettempdir()).glob(f"{RENDEZVOUS_PREFIX}{run_id}_*"))
        assert rendezvous, "the ranks met through a file named by the run"
        os.kill(run.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        run.wait(timeout=60)
    finally:
        run.kill()
        run.wait()
    assert not (left := _left_behind(tag, timeout_s=30)), left

    def same_process(pid: int) -> psutil.Process | None:  # (a PID is reused once its process is gone)
        try:
            process = psutil.Process(pid)
            return process if process.create_time() == born[pid] else None
        except psutil.NoSuchProcess:
            return None

    # A killed process can take a moment to finish exiting (its memory already gone: no environment, no command
    # line), so the tag-based check above no longer sees it: wait for their exits too, within the same 30 s.
    processes = [p for p in map(same_process, born) if p is not None]
    _, alive = psutil.wait_procs(processes, timeout=max(0.0, killed_at + 30 - time.monotonic()))
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.status(), " ".join(p.cmdline())) for p in alive]
    assert shared_memory() == [], f"left in /dev/shm by the run's processes: {shared_memory()}"
    assert not any(path.exists() for path in rendezvous), rendezvous  # removed by the reaper
