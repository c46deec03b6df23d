"""Multi-node runs through Slurm: real sbatch jobs on a local Slurm.

The module starts a two-node Slurm on this machine (tools/slurm_local.sh: nodes n1 and n2, each its
own slurmd) and submits the sbatch files in slurm/. Every job goes through the shared bring-up
(slurm/ray_on_slurm.sh), so each test checks it from a different side:

- the tiny recipe on both nodes: Ray head on n1, a worker joined from n2 through srun, two GRPO
  steps, logs and a checkpoint in the shared directory, Ray gone afterwards, exit code 0;
- the 70B recipe's pre-flight (`--plan-only`): megarl-plan through the same bring-up, exit 0;
- a trainer that fails: the job's exit code is the trainer's;
- a node that never joins (MEGARL_RAY_SKIP_NODES): the job fails within MEGARL_RAY_TIMEOUT with
  an error naming that node, for a worker and for the head.

Needs root (slurmd starts jobs as their users); where Slurm is missing it is installed with apt-get
(`.ci/run` does that on CI). Skipped, saying why, where neither is possible. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "tools" / "slurm_local.sh"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}
# Small and fast: a random tiny Qwen2 (no SFT warm start), 4 prompts x 4 samples, two steps.
TINY_OVERRIDES = [
    "trainer.total_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
    "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "trainer.logger=[console,jsonl,tensorboard]",
]


@dataclasses.dataclass
class Job:
    """A finished Slurm job: its id, state, exit code and output."""

    job_id: str
    state: str
    exit_code: int
    output: str

    def lines(self, marker: str = "[ray_on_slurm") -> list[str]:
        """The bring-up's lines."""
        return [line for line in self.output.splitlines() if line.startswith(marker)]


def _free_base_port() -> int:
    """A slurmctld port P with P, P+101 and P+102 (the two slurmds) free on this machine."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(30000, 32000)
        try:
            for port in (base, base + 101, base + 102):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports for a local Slurm in 30000-32102")


@pytest.fixture(scope="module")
def slurm_env():
    """A two-node local Slurm of this test run alone; the environment jobs are submitted with.

    Its own state directory, ports and first job id: another test run on the machine (another checkout's CI)
    with its own Slurm never meets this one's nodes, jobs or Ray temp dirs.
    """
    if os.geteuid() != 0:
        pytest.skip("the local Slurm needs root (slurmd starts jobs as their users); tools/slurm_local.sh")
    state = tempfile.mkdtemp(prefix="megarl-slurm-", dir="/var/tmp")
    own = {"MEGARL_SLURM_STATE": state, "MEGARL_SLURM_PORT": str(_free_base_port()),
           "MEGARL_SLURM_FIRST_JOB_ID": str(100 * (os.getpid() % 9000 + 1))}
    start = subprocess.run(["bash", str(SLURM_LOCAL), "start", "--nodes", "2"], capture_output=True, text=True,
                           timeout=900, env={**os.environ, **own})
    try:
        if start.returncode == 2:  # cannot install or run Slurm here (no root, no apt-get)
            pytest.skip(f"no local Slurm: {start.stderr.strip() or 'tools/slurm_local.sh start exited 2'}")
        assert start.returncode == 0, f"tools/slurm_local.sh start failed:\n{start.stderr}"
        env = dict(os.environ)
        # The jobs run megarl-train, megarl-plan and ray from this interpreter's environment.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["SLURM_CONF"] = f"{state}/slurm.conf"
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):  # as a user submits: slurm/env.sh turns token auth on
            env.pop(name, None)
        yield env
    finally:
        subprocess.run(["bash", str(SLURM_LOCAL), "stop"], capture_output=True, timeout=120, env={**os.environ, **own})
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megarl.models.tiny import save_tiny
    from megarl.warmstart.addition_data import ensure_addition_data

    root = tmp_path_factory.mktemp("slurm_assets")
    train, test = ensure_addition_data(root / "data", num_train=64, num_test=8, seed=0)
    model = save_tiny(root / "model", num_layers=2)
    return ["actor_rollout_ref.model.init=pretrained", f"actor_rollout_ref.model.path={model}",
            f"data.train_files=[{train}]", f"data.val_files=[{test}]"]


def _job_field(job_id: str, env: dict[str, str], name: str) -> str | None:
    info = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True).stdout
    match = re.search(rf"\b{name}=(\S+)", info)
    return match.group(1) if match else None


def run_job(env: dict[str, str], workdir: Path, script: str, *args: str, sbatch_args: tuple[str, ...] = (),
            extra_env: dict[str, str] | None = None, timeout_s: float = 240) -> Job:
    """Submit slurm/<script> with args and wait for it (polling: faster than `sbatch --wait`); scancel on timeout."""
    workdir.mkdir(parents=True, exist_ok=True)
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={workdir}/%x-%j.out", *sbatch_args, str(REPO / "slurm" / script), *args],
        env={**env, **(extra_env or {})}, cwd=workdir, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}"
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout_s
    while (state := _job_field(job_id, env, "JobState")) not in TERMINAL:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            outputs = "".join(p.read_text() for p in workdir.glob(f"*-{job_id}.out"))
            pytest.fail(f"job {job_id} ({script}) still {state} after {timeout_s} s; cancelled. Output:\n{outputs[-5000:]}")
        time.sleep(0.5)
    exit_code = int(_job_field(job_id, env, "ExitCode").split(":")[0])
    output = "".join(p.read_text() for p in workdir.glob(f"*-{job_id}.out"))
    return Job(job_id, state, exit_code, output)


def _ray_processes(job_id: str) -> list[str]:
    """Command lines of processes that belong to the job's Ray (its temp dir is in them)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"/tmp/ray_megarl_{job_id}" in text:
            found.append(text)
    return found


def _seconds(line: str) -> int:
    h, m, s = re.search(r"\[ray_on_slurm (\d\d):(\d\d):(\d\d)\]", line).groups()
    return int(h) * 3600 + int(m) * 60 + int(s)


def test_tiny_recipe_on_two_nodes(slurm_env, assets, tmp_path):
    """sbatch slurm/train_grpo_tiny.sh: Ray on both nodes, two GRPO steps, logs and a checkpoint, exit 0."""
    shared = tmp_path / "shared"
    job = run_job(slurm_env, tmp_path, "train_grpo_tiny.sh", *assets, *TINY_OVERRIDES, sbatch_args=("--nodes=2",),
                  extra_env={"MEGARL_SHARED_DIR": str(shared)})
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output[-5000:]
    bringup = "\n".join(job.lines())
    assert "2 node(s) n1 n2; Ray head on n1" in bringup
    assert "all 2 nodes joined the Ray cluster" in bringup
    assert "running: megarl-train recipe=tiny_cpu_grpo" in bringup
    assert "stopping Ray on 2 node(s)" in bringup and bringup.endswith("exit code 0")
    assert re.search(r"^step 2: ", job.output, re.M), job.output[-3000:]

    runs = shared / "runs" / "megarl" / "tiny_cpu_grpo"
    steps = [json.loads(line)["step"] for line in (runs / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert list(runs.glob("events.out.tfevents.*"))
    checkpoints = shared / "checkpoints" / "megarl" / "tiny_cpu_grpo"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (checkpoints / "global_step_2" / "trainer_state.json").is_file()
    assert list((checkpoints / "global_step_2" / "actor").iterdir())
    # Torn down: no process of the job's Ray is left, and its temp dir is gone after a good run.
    assert _ray_processes(job.job_id) == []
    assert not Path(f"/tmp/ray_megarl_{job.job_id}").exists()


def test_plan_only_70b(slurm_env, tmp_path):
    """sbatch slurm/train_grpo_70b.sh --plan-only: megarl-plan for the 8 x 8 GPU recipe through the same bring-up."""
    if shutil.which("megarl-plan", path=slurm_env["PATH"]) is None:
        pytest.skip("megarl-plan is not installed in this environment (pip install -e . installs it)")
    # The header asks for 8 nodes x 8 GPUs; the command line wins: one CPU node plans the recipe's own layout.
    job = run_job(slurm_env, tmp_path, "train_grpo_70b.sh", "--plan-only",
                  sbatch_args=("--nodes=1", "--gpus-per-node=0"), extra_env={"MEGARL_SHARED_DIR": str(tmp_path)})
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output[-5000:]
    bringup = "\n".join(job.lines())
    assert "all 1 nodes joined the Ray cluster" in bringup
    assert "running: megarl-plan recipe=llama3_1_70b_grpo" in bringup
    assert "megarl-plan: recipe llama3_1_70b_grpo" in job.output
    assert "GPUs: 8 node(s) x 8" in job.output and re.search(r"^fits: ", job.output, re.M), job.output[-3000:]
    assert _ray_processes(job.job_id) == []


def test_failing_trainer_exit_code_is_the_jobs(slurm_env, tmp_path):
    """A trainer that exits 2 (invalid config) ends the job with 2, after tearing Ray down."""
    job = run_job(slurm_env, tmp_path, "train_grpo_tiny.sh", "trainer.save_freq=0",
                  extra_env={"MEGARL_SHARED_DIR": str(tmp_path)})
    assert (job.state, job.exit_code) == ("FAILED", 2), job.output[-5000:]
    assert re.search(r"^megarl-train: invalid config: .*trainer\.save_freq", job.output, re.M), job.output[-3000:]
    bringup = "\n".join(job.lines())
    assert "stopping Ray on 1 node(s)" in bringup and bringup.endswith("exit code 2")
    assert _ray_processes(job.job_id) == []
    shutil.rmtree(f"/tmp/ray_megarl_{job.job_id}", ignore_errors=True)  # kept after a failure, for its logs


# The worker case needs the head up first (5-10 s on 2 busy cores), so its timeout is longer.
@pytest.mark.parametrize("nodes,skip,timeout_s", [(2, "n2", 15), (1, "n1", 5)], ids=["worker", "head"])
def test_node_that_never_joins_fails_within_timeout(slurm_env, tmp_path, nodes, skip, timeout_s):
    """A node whose Ray never joins ends the job within MEGARL_RAY_TIMEOUT, naming the node; no trainer runs."""
    job = run_job(slurm_env, tmp_path, "train_grpo_tiny.sh", sbatch_args=(f"--nodes={nodes}",),
                  extra_env={"MEGARL_SHARED_DIR": str(tmp_path), "MEGARL_RAY_SKIP_NODES": skip,
                             "MEGARL_RAY_TIMEOUT": str(timeout_s)}, timeout_s=120)
    assert (job.state, job.exit_code) == ("FAILED", 1), job.output[-5000:]
    lines = job.lines()
    error = next(line for line in lines if "error:" in line)
    assert error.endswith(f"missing: {skip}"), error
    assert _seconds(error) - _seconds(lines[0]) <= timeout_s + 60, lines  # at its limit, not at the job's
    assert "running:" not in "\n".join(lines)
    assert lines[-1].endswith("exit code 1")
    assert _ray_processes(job.job_id) == []
    shutil.rmtree(f"/tmp/ray_megarl_{job.job_id}", ignore_errors=True)
