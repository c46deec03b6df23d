"""End-to-end training on CPU through Ray: GRPO and PPO steps, resume, failures.

One local Ray cluster for the module; every trainer places its own workers (actor TP=2 on
2 gloo ranks with the reference in the same processes, 2 HF engines, a TP=2 critic for
PPO) and kills them at the end. The model is a tiny random Qwen2 built by project code; the
reward is a test function with spread inside every GRPO group (the share of digits in the
response), so advantages are non-zero and every update moves the policy.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402
import torch  # noqa: E402

ray = pytest.importorskip("ray")

from megarl.config import load_config  # noqa: E402
from megarl.controller.judge import JudgeError  # noqa: E402
from megarl.controller.run_checkpoints import CheckpointManager  # noqa: E402
from megarl.controller.trainer import Trainer  # noqa: E402
from megarl.workers.group import WorkerError  # noqa: E402

HERE = Path(__file__).resolve().parent
# Metrics that measure time, or depend on it, differ between two identical runs.
TIMED = ("timing_s/", "timing_per_token_ms/", "perf/", "weight_sync/seconds", "weight_sync/gbps",
         "checkpoint/")
ONE_RANK = ("trainer.n_cpu_ranks=1", "actor_rollout_ref.actor.parallel.tp=1")
"""The actor on one rank and one engine: for the tests whose subject is not the layout (the recipe's TP=2 actor
with two engines is the subject of the resume, FP8, LoRA and weight-sync tests), half the processes to start."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megarl.models.tiny import save_tiny
    from megarl.warmstart.addition_data import ensure_addition_data

    root = tmp_path_factory.mktemp("e2e")
    train, test = ensure_addition_data(root / "data", num_train=64, num_test=8, seed=0)
    model = save_tiny(root / "model", num_layers=2)
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}})
    yield {"root": root, "train": str(train), "test": str(test), "model": str(model)}
    ray.shutdown()


def _config(assets, name: str, *extra: str):
    return load_config(_overrides(assets, name, *extra))


def _overrides(assets, name: str, *extra: str) -> list[str]:
    root = assets["root"]
    return [
        "recipe=tiny_cpu_grpo",
        "actor_rollout_ref.model.init=pretrained", f"actor_rollout_ref.model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['test']}]",
        "data.train_batch_size=4", "data.val_batch_size=8", "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.verify_weights=-1",
        f"reward_model.custom_reward_function.path={HERE / 'rewards.py'}",
        "reward_model.custom_reward_function.name=digit_share",
        "trainer.logger=[jsonl,tensorboard]", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"trainer.default_local_dir={root / name / 'ckpt'}",
        f"trainer.log_dir={root / name / 'runs'}", f"trainer.experiment_name={name}", *extra]


def _unverifiable(metrics: dict[str, float], engines: int = 2) -> None:
    """SGLang's Qwen2 (its MoE and VL models, DeepSeek-V3) has no ``get_weights_by_name``, and megarl's CPU engine
    answers as SGLang does: the weight sync asks, gets HTTP 400 and reports every engine unverified (the run warns
    once). The engines' log-probs against the trainer's (``mismatch/abs_logp_diff_mean``, bounded by each test) are
    then the check that the weights arrived."""
    assert metrics["weight_sync/engines"] == engines
    assert metrics["weight_sync/verified_engines"] == 0 and metrics["weight_sync/verified_tensors"] == 0


@pytest.mark.slow
def test_a_generative_judge_scores_every_row_and_its_failures_are_counted(assets):
    """A GRPO run scored by a generative judge (a model served by a CPU engine server of its own, on a pool
    of its own, behind a router of its own): every row is asked, the verdicts logged with the answers they were read
    from; rows with garbage answers are counted and left out of the update, and the run goes on. A judge whose
    every answer is garbage stops the run at its first step, naming the setting."""
    from megarl.workers.engine_server import EngineServerWorker

    root = assets["root"] / "judge"
    judge = ["reward_model.judge.enable=true", f"reward_model.judge.model.path={assets['model']}",
             "reward_model.judge.pool_nodes=[1]", "reward_model.judge.rollout.response_length=6",
             "reward_model.judge.rollout.temperature=1.0"]
    messages: list[str] = []
    trainer = Trainer(_config(assets, "judge", *ONE_RANK, "trainer.total_steps=2", "trainer.val_before_train=true",
                              f"trainer.rollout_data_dir={root / 'rollouts'}", *judge,
                              f"reward_model.judge.verdict_parser={HERE / 'rewards.py'}:judge_verdict",
                              "reward_model.judge.max_failure_share=1.0"), console=messages.append)
    try:
        trainer.fit()
        assert [e.pool for e in trainer.roles.plan.judge_engines] == ["judge"]
        assert trainer.roles.judge.router.url != trainer.roles.router.url
        servers = trainer.roles.judge
        judge_pids = servers.group.call_all(EngineServerWorker.server_pid) + [servers.router.pid]
    finally:
        trainer.shutdown()
    alive = _alive_after(judge_pids)  # the judge's server and router end with the run
    assert not alive, f"judge processes outlived the run: {alive}"
    assert len(trainer.history) == 2
    counted = {key: sum(m[f"judge/{key}"] for _, m in trainer.history) for key in ("num_verdicts", "num_garbage")}
    assert counted["num_verdicts"] > 0 and counted["num_garbage"] > 0, counted  # both kinds of rows occur
    for step, metrics in trainer.history:
        rows = [json.loads(line) for line in (root / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        garbage = [r for r in rows if r["judge_error"]]
        for row in rows:  # each verdict is the parser's reading of the answer logged beside it
            length = len(row["judge_answer"])
            if length % 3 == 0:
                assert row["judge_error"].startswith("garbage:") and row["judge_score"] is None
            else:
                assert row["judge_verdict"] == length % 11 and row["judge_score"] == pytest.approx(length % 11 / 10)
                assert row["score"] == row["judge_score"]
        assert metrics["judge/num_verdicts"] == len(rows) - len(garbage) and len(rows) == 16
        assert metrics["judge/num_garbage"] == len(garbage)
        assert metrics["judge/failure_share"] == pytest.approx(len(garbage) / 16)
        assert metrics["judge/num_timeout"] == metrics["judge/num_error"] == 0
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/skipped_steps"] == 0
        if garbage:
            assert any(f"step {step}: {len(garbage)} of 16 rows could not be scored by the judge" in m
                       for m in messages), messages
    (_, validation), = trainer.validations[:1]
    assert validation["val-judge/num_verdicts"] + validation["val-judge/num_garbage"] == 8
    # Every answer garbage (no <score>N</score> from a random model): the first step stops the run.
    stopped = Trainer(_config(assets, "judge_stops", *ONE_RANK, "trainer.total_steps=2", *judge,
                              "reward_model.judge.max_failure_share=0.5"), console=lambda *_: None)
    try:
        with pytest.raises(JudgeError, match=r"step 1: the judge could not score 16 of 16 rows \(garbage 16\), over "
                                             r"reward_model.judge.max_failure_share=0.5"):
            stopped.fit()
    finally:
        stopped.shutdown()
    assert stopped.history == []


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_fp8_rollout_syncs_quantized_weights_and_measures_their_gap(assets, transport):
    """Engines serving block FP8 (CPU engine servers started from the run's FP8 copy of the policy) get
    every sync's linear weights quantized, by either transport: every tensor and every scale read back equal to the
    quantized bits; the rollout/training gap is FP8's (measured: 3.4e-3 nat per token against ~1e-6 without), and
    rollout correction reports it."""
    from transformers import AutoConfig

    from megarl.convert.fp8 import ENGINE_DIR, fp8_names
    from megarl.models import family_for

    layout = [] if transport == "tensor" else ["actor_rollout_ref.hybrid_engine=false",
                                                "actor_rollout_ref.rollout.pool_nodes=[2]"]
    trainer = _run(_config(assets, f"fp8_{transport}", "trainer.total_steps=1",
                           "actor_rollout_ref.rollout.quantization=fp8", "algorithm.rollout_correction.rollout_is=token",
                           *layout))
    (_, metrics), = trainer.history
    assert trainer.roles.weight_transport == transport
    assert (trainer.run_dir / ENGINE_DIR / "config.json").is_file()
    config = AutoConfig.from_pretrained(assets["model"])
    quantized = fp8_names(family_for(config), config)
    assert len(quantized) == 2 * 7
    _unverifiable(metrics)
    assert metrics["mismatch/abs_logp_diff_mean"] > 1e-3  # FP8's gap (at most 1e-5 without it: the other tests)
    assert metrics["rollout_corr/kl"] != 0 and math.isfinite(metrics["actor/pg_loss"])
    assert metrics["rollout_corr/rollout_is_mean"] > 0


def _run(cfg) -> Trainer:
    trainer = Trainer(cfg, console=lambda *_: None)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return trainer


def _train_cli(overrides: list[str], cwd: str | os.PathLike | None = None, timeout_s: float = 1200,
               **environ: str | None):
    """``megarl-train`` with ``overrides`` in a process of its own (its own local Ray cluster), finished, run in
    ``cwd``; ``environ`` sets (or, with None, removes) environment variables."""
    import subprocess
    import sys

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", **environ}
    for name in ["RAY_ADDRESS", *(name for name, value in environ.items() if value is None)]:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "megarl.cli.train", *overrides], env=env, capture_output=True,
                          text=True, timeout=timeout_s, cwd=cwd)


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(TIMED)}


@pytest.mark.slow
def test_grpo_steps_resume_and_crashed_save(assets):
    """GRPO through Ray; a run resumed from step 1's checkpoint repeats steps 2..3 exactly.

    The uninterrupted run also validates, dumps rollouts and saves every step (and exports at the end). Its step-1
    checkpoint is committed into a second run directory (the run that stopped after step 1), where a save of step
    2 then "crashes" half-way (a worker wrote its part, the controller never committed): the resume must still
    find step 1.
    """
    root = assets["root"]
    full = _run(_config(assets, "grpo", "trainer.total_steps=3", "trainer.test_freq=3", "trainer.save_freq=1",
                        "trainer.export_hf=true", f"trainer.rollout_data_dir={root / 'grpo' / 'dumps'}",
                        "trainer.log_val_generations=3"))
    assert [s for s, _ in full.history] == [1, 2, 3]
    assert full.roles.weight_transport == "tensor"  # colocated engines open handles to the actor's buckets
    # The buckets' shared-memory files of the run's (killed) workers are gone with the run.
    from megarl.parallel.shared_memory import shared_memory_files

    pids = [info["pid"] for group in full.roles.groups for info in group.node_infos]
    assert len(pids) >= 2 and shared_memory_files(pids) == []
    for step, metrics in full.history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"
        _unverifiable(metrics)  # the engines' log-probs are the trainer's after every sync:
        assert metrics["mismatch/abs_logp_diff_mean"] <= 1e-5, metrics["mismatch/abs_logp_diff_mean"]
        assert metrics["actor/skipped_steps"] == 0
        assert metrics["actor/grad_norm"] > 0
        # 16 trajectories per step, mini-batches of 2 prompts x n=4 -> 2 optimizer steps per step.
        assert metrics["perf/total_num_tokens"] > 0
    last = full.history[-1][1]
    core = [key for key in last if key.startswith("val-core/")]  # verl's names: val-core/<source>/<var>/mean@1
    assert core and all(0 <= last[key] <= 1 and key.endswith("/reward/mean@1") for key in core), core
    assert (root / "grpo" / "dumps" / "3.jsonl").read_text().count("\n") == 16
    assert any((root / "grpo" / "runs" / "megarl" / "grpo").glob("events.out.tfevents.*"))
    # trainer.log_val_generations=3: the first three validation samples of the step-3 validation.
    generations = root / "grpo" / "runs" / "megarl" / "grpo" / "generations.jsonl"
    logged = [json.loads(line) for line in generations.read_text().splitlines()]
    assert [row["step"] for row in logged] == [3, 3, 3]
    assert all(row["input"] and 0 <= row["score"] <= 1 for row in logged)
    saved = CheckpointManager(full.run_dir).latest()
    assert saved.name == "global_step_3"
    # The HF export of the final weights loads in transformers and differs from the initial model.
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(saved / "actor_hf").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(assets["model"]).state_dict()
    assert exported.keys() == initial.keys()
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)
    _convert_run_root_equals_the_export(full.run_dir, saved, root / "grpo" / "converted")

    # The run stopped after step 1: its checkpoint (the uninterrupted run's, committed into its own directory);
    # then a save of step 2 crashes; resume to step 3.
    import shutil

    resume_dir = Path(_config(assets, "resume").trainer.default_local_dir) / "megarl" / "resume"
    manager = CheckpointManager(resume_dir)
    source = CheckpointManager(full.run_dir).path(1)
    state = json.loads((source / "trainer_state.json").read_text())
    state.pop("step")
    tmp = manager.begin(1)
    shutil.copytree(source, tmp, dirs_exist_ok=True)
    manager.commit(1, tmp, state)
    tmp = manager.begin(2)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "metadata.json").write_text("{}")  # a worker's half-written part; no commit
    assert manager.latest().name == "global_step_1"
    resumed = _run(_config(assets, "resume", "trainer.total_steps=3"))
    assert [s for s, _ in resumed.history] == [2, 3]
    assert resumed.run_dir == resume_dir
    assert not list(resume_dir.glob(".tmp*")), "the crashed save's debris is cleaned at start-up"
    for (step, expected), (_, got) in zip(full.history[1:], resumed.history, strict=True):
        want, have = _untimed(expected), _untimed(got)
        want = {k: v for k, v in want.items() if not k.startswith(("val-core/", "val-aux/"))}
        assert want.keys() <= have.keys()
        diffs = {k: (want[k], have[k]) for k in want if want[k] != have[k]}
        assert not diffs, f"step {step} differs after resume: {diffs}"


def _convert_run_root_equals_the_export(run_dir: Path, saved: Path, out: Path) -> None:
    """``megarl-convert mcore-to-hf --mcore <run root>`` turns the run's last checkpoint (the actor at
    TP=2, saved with its optimizer) into an HF directory that transformers loads, holding the tensors the trainer's
    own export wrote bit for bit, so its logits equal the trained actor's exactly (fp32, same weights, same kernels)."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "megarl.cli.convert", "mcore-to-hf", "--mcore", str(run_dir),
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"is the checkpoint {saved / 'actor'}" in run.stdout, run.stdout
    want, got = load_file(saved / "actor_hf" / "model.safetensors"), load_file(out / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(d).eval()(input_ids=ids).logits for d in (out, saved / "actor_hf")]
    assert torch.equal(*logits), (logits[0] - logits[1]).abs().max()


def test_ppo_with_critic(assets):
    """PPO with GAE: the critic trains alone for one warm-up step, then both update.

    Also: token-budget micro-batches on every role, engines on their own pool (disaggregated), and the actor's
    micro-batches padded (``model.use_remove_padding=false``) while the critic's are packed.
    """
    trainer = _run(_config(assets, "ppo", "trainer.total_steps=2", "algorithm.adv_estimator=gae",
                           "critic.enable=true", "critic.parallel.tp=2", "critic.ppo_mini_batch_size=2",
                           "critic.ppo_micro_batch_size_per_gpu=4", "critic.forward_micro_batch_size_per_gpu=8",
                           "critic.optim.lr=1e-3", "trainer.critic_warmup=1",
                           "actor_rollout_ref.model.use_remove_padding=false",
                           "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=true",
                           # token-budget micro-batches on every role
                           "actor_rollout_ref.actor.use_dynamic_bsz=true",
                           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
                           "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                           "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=96",
                           "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=64",
                           # disaggregated: the two engines on their own pool
                           "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.pool_nodes=[2]"))
    (_, warm), (_, both) = trainer.history
    for metrics in (warm, both):
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["critic/vf_loss"] > 0 and metrics["critic/grad_norm"] > 0
        assert "critic/values/mean" in metrics and "critic/kl" in metrics
    assert "actor/pg_loss" not in warm and "weight_sync/verified_tensors" not in warm
    assert "actor/pg_loss" in both
    # Engines on their own pool get the weights by broadcast.
    assert trainer.roles.weight_transport == "distributed"
    _unverifiable(both)
    assert both["mismatch/abs_logp_diff_mean"] <= 1e-5
    assert set(trainer.roles.plan.pools) == {"global", "rollout"}


def test_an_async_reward_function_and_validation_with_several_samples(assets):
    """A step scored by an ``async def`` reward function (verl accepts one; it used to fail at the first scored
    step), then validation with ``val_kwargs.n=4`` (sampled): each of the 8 validation prompts gets 4 responses,
    and the run reports verl's ``mean@4`` / ``best@k`` / ``worst@k`` per data source; best@4 >= mean@4 >=
    worst@4."""
    trainer = _run(_config(assets, "val_n", *ONE_RANK, "trainer.total_steps=1", "trainer.test_freq=1",
                           "reward_model.custom_reward_function.name=digit_share_async",
                           "actor_rollout_ref.rollout.val_kwargs.n=4",
                           "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                           "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"))
    (_, metrics), = trainer.history
    assert 0 < metrics["critic/score/mean"] <= 1  # the digit share of the responses, awaited row by row
    core = {key.split("/", 2)[2]: value for key, value in metrics.items() if key.startswith("val-core/")}
    assert {"reward/mean@4", "reward/best@4/mean", "reward/best@4/std"} <= set(core), metrics
    aux = {key.split("/", 2)[2]: value for key, value in metrics.items() if key.startswith("val-aux/")}
    assert core["reward/best@4/mean"] >= core["reward/mean@4"] >= aux["reward/worst@4/mean"]
    assert {"reward/std@4", "reward/best@2/mean", "reward/worst@2/mean"} <= set(aux)


def test_greedy_rollouts_recompute_at_the_recorded_temperature(assets):
    """``rollout.do_sample=false`` with ``temperature=0.7``: the engines decode greedily and report log-probs at
    T=1 (the batch's meta says so); the actor recomputes at the meta's temperature, not the setting's.

    REINFORCE++ (GRPO would refuse greedy samples: they are alike), with the engines on their own pool: the weights go by broadcast, every tensor read back;
    and with context parallelism on the actor (cp=2, packed): the recomputed log-probs gathered over the CP ranks
    equal the engines', and the weights the CP ranks send are the engines' after the update."""
    trainer = _run(_config(assets, "greedy", "trainer.total_steps=1", "actor_rollout_ref.rollout.do_sample=false",
                           "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.n=1",
                           "algorithm.adv_estimator=reinforce_plus_plus",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                           "actor_rollout_ref.actor.parallel.tp=1", "actor_rollout_ref.actor.parallel.cp=2",
                           "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.pool_nodes=[2]",
                           # rollout correction on a matched engine: weights of 1, nothing rejected
                           "algorithm.rollout_correction.rollout_is=sequence",
                           "algorithm.rollout_correction.rollout_rs=token_k1",
                           "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'"))
    (_, metrics), = trainer.history
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert abs(metrics["rollout_corr/rollout_is_mean"] - 1.0) <= 1e-4 and metrics["rollout_corr/kl"] <= 1e-5
    assert trainer.roles.weight_transport == "distributed"
    assert trainer.cfg.actor_rollout_ref.actor.parallel.cp == 2
    _unverifiable(metrics)
    # Recomputing at 0.7 instead differs by 0.43 nat per token on this model (measured).
    assert metrics["mismatch/abs_logp_diff_mean"] <= 1e-5, metrics["mismatch/abs_logp_diff_mean"]
    assert metrics["actor/skipped_steps"] == 0


def test_nan_loss_is_skipped_and_a_killed_worker_ends_the_run(assets):
    """An overflowing (3e38) reward makes the loss NaN: the update is skipped, reported, the weights unchanged.
    Then a killed actor rank ends the next step, seen dead (not waited out), naming role and rank."""
    cfg = _config(assets, "failures", "trainer.total_steps=1", "reward_model.custom_reward_function.name=overflow_reward")
    trainer = Trainer(cfg, console=lambda *_: None)
    try:
        trainer.fit()
        (_, metrics), = trainer.history
        assert metrics["actor/skipped_steps"] == 2  # both mini-batches
        assert math.isnan(metrics["actor/loss"])
        # Nothing was applied: the engines (synced after the step) hold the initial weights, read whole by megarl's
        # own look into its CPU engine (SGLang's Qwen2 reads nothing back).
        _unverifiable(metrics)
        from safetensors.torch import load_file

        from megarl.engines.client import run_sync
        from megarl.engines.cpu_engine.read_back import inspect_weight

        initial = load_file(str(Path(assets["model"]) / "model.safetensors"))
        for name in trainer.roles.weight_names:
            held = run_sync(inspect_weight(trainer.roles.engines[0].url, name))
            assert held.equal(initial[name].float()), name
        trainer.roles.actor.kill_rank(1)
        with pytest.raises(WorkerError) as error:
            trainer.train_step()
        assert error.value.role == "actor" and error.value.rank == 1
        # Seen dead, not waited out (trainer.worker_timeout_s is 1800 s): on a machine of any speed.
        assert "actor rank 1 died during" in str(error.value), str(error.value)
    finally:
        trainer.shutdown()


def test_rows_the_reward_function_cannot_score_are_skipped_and_counted(assets):
    """``reward_model.on_error=skip``: rows whose reward function raises score 0, are left out of the
    update (all-zero loss mask) and counted; the step trains on the others."""
    messages = []
    cfg = _config(assets, "reward_skip", *ONE_RANK, "trainer.total_steps=1", "data.shuffle=false",
                  "reward_model.custom_reward_function.name=even_prompts_raise", "reward_model.on_error=skip")
    trainer = Trainer(cfg, console=messages.append)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    (_, metrics), = trainer.history
    assert metrics["reward/num_errors"] == 8  # prompts 0 and 2 of 0..3, n=4 samples each
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/pg_loss"])
    assert any("step 1: 8 of 16 rows could not be scored and are left out of the update (reward_model.on_error=skip);"
               " the first: row 0 (prompt index 0, data_source 'addition'): custom reward function "
               in m and "raised ConnectionError: judge unavailable for prompt 0" in m for m in messages), messages


def test_dynamic_sampling_trains_only_groups_with_signal(assets):
    """DAPO's filter in a synchronous run (``algorithm.filter_groups``, metric ``acc`` from the reward function's
    extras): groups of even prompts score the same on every sample and are left out; further batches are generated
    until a step has train_batch_size groups; the counts are reported."""
    import json

    dumps = assets["root"] / "dapo" / "dumps"
    trainer = _run(_config(assets, "dapo", *ONE_RANK, "trainer.total_steps=2", f"trainer.rollout_data_dir={dumps}",
                           "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                           "reward_model.custom_reward_function.name=flat_on_even_prompts"))
    batches = 0
    for step, metrics in trainer.history:
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 and all(row["prompt_index"] % 2 == 1 for row in rows)
        assert len({row["uid"] for row in rows}) == 4
        assert metrics["dapo/gen_batches"] >= 2 and metrics["dapo/groups_filtered"] >= 1
        batches += metrics["dapo/gen_batches"]
        assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/pg_loss"])
    assert trainer.loader.position == batches  # every generated batch consumed its prompts


def test_multi_turn_grpo_with_tools(assets, tmp_path):
    """Multi-turn rollouts through Ray: the agent loop drives remote engines with the GSM8K tool."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i in range(8):
        a, b = i + 3, 2 * i + 1
        answer = str(a + b)
        rows.append({"data_source": "openai/gsm8k", "ability": "math",
                     "prompt": [{"role": "system", "content": "Use the tool to check your answer."},
                                {"role": "user", "content": f"Tom has {a} apples and gets {b} more. How many?"}],
                     "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"split": "train", "index": i, "need_tools_kwargs": True,
                                    "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}}}})
    data = tmp_path / "gsm8k_tools.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    tools = Path(__file__).resolve().parents[2] / "configs" / "tools" / "gsm8k_tool_config.yaml"
    trainer = _run(_config(assets, "multi_turn", *ONE_RANK, "trainer.total_steps=1", f"data.train_files=[{data}]",
                           "data.val_files=[]", "data.max_prompt_length=512", "data.max_response_length=24",
                           "data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                           # the tiny model's chat template is Qwen2.5's: SGLang's qwen25 parser reads its calls
                           "actor_rollout_ref.rollout.multi_turn.format=qwen25",
                           "reward_model.custom_reward_function.path=null",
                           "reward_model.custom_reward_function.name=compute_score"))
    (_, metrics), = trainer.history
    assert all(math.isfinite(v) for v in metrics.values())
    # Every request ran (none aborted): the tool was created from each row's tools_kwargs.
    assert "rollout/finish_abort_frac" not in metrics
    assert metrics["response_length/mean"] > 0
    assert metrics["mismatch/abs_logp_diff_mean"] <= 1e-5
    _unverifiable(metrics, engines=1)


def test_multi_turn_ppo_critic_trains_on_the_actors_tokens(assets, tmp_path):
    """Multi-turn PPO with a simulated user (the GSM8K interaction: the tiny model never writes ``#### n``, so the
    user asks again after each turn): the user's tokens are in the responses but do not train. The critic's
    value loss covers exactly the tokens the actor trains on: with one mini-batch and one micro-batch its
    ``vpred_mean`` (the values of the tokens in its loss, before its step) is the batch's ``critic/values/mean``
    over ``response_mask``; it used to include the user's tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    rows = []
    for i in range(4):
        a, b = 10 + i, 20 + 3 * i
        rows.append({"data_source": "addition", "ability": "math",
                     "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"index": i, "interaction_kwargs": {"name": "gsm8k", "ground_truth": str(a + b)}}})
    data = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    interactions = tmp_path / "interaction.yaml"
    interactions.write_text(yaml.safe_dump({"interaction": [
        {"name": "gsm8k", "class_name": "megarl.rollout.interaction.Gsm8kInteraction", "config": {}}]}))
    trainer = _run(_config(assets, "multi_turn_ppo", *ONE_RANK, "trainer.total_steps=1", f"data.train_files=[{data}]",
                           "data.val_files=[]", "data.max_prompt_length=128", "data.max_response_length=160",
                           "data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                           "actor_rollout_ref.rollout.multi_turn.max_turns=2",
                           f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={interactions}",
                           "algorithm.adv_estimator=gae", "critic.enable=true",
                           "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=16",
                           "critic.forward_micro_batch_size_per_gpu=16"))
    (_, metrics), = trainer.history
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["multi_turn/num_user_turns/mean"] > 0  # the user's replies are in some responses
    print(f"vpred_mean {metrics['critic/vpred_mean']:.7f} values/mean {metrics['critic/values/mean']:.7f}")
    assert metrics["critic/vpred_mean"] == pytest.approx(metrics["critic/values/mean"], abs=1e-5)


def test_hanging_tool_hooks_cost_their_time_limit_and_are_counted(assets, tmp_path):
    """Tool hooks that never return (create and release blocking their thread,
    calc_reward awaiting forever) used to stall training (0 steps in 240 s). Each now costs tool_timeout_s=2,
    is counted per hook, fails its rollout where the result matters, and the run trains on."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    hangs = {0: "create", 1: "calc_reward", 2: "release", 4: "create"}  # rows 0-3 are step 1, rows 4-7 step 2
    rows = [{"data_source": "test/hang", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"ground_truth": str(i + 1)},
             "extra_info": {"index": i, "tools_kwargs": {"hang": {"create_kwargs": {"hang": hangs.get(i, "none")}}}}}
            for i in range(8)]
    data = tmp_path / "hang.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    tools = tmp_path / "hang_tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{
        "class_name": "tests.e2e.hanging_tool.HangingTool", "config": {},
        "tool_schema": {"type": "function", "function": {"name": "hang", "description": "Hangs on some rows.",
                                                         "parameters": {"type": "object", "properties": {}}}}}]}))
    start = time.monotonic()
    trainer = _run(_config(assets, "hanging_tool", *ONE_RANK, "trainer.total_steps=2", f"data.train_files=[{data}]",
                           "data.val_files=[]", "data.shuffle=false", "data.max_prompt_length=320",
                           "data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                           "actor_rollout_ref.rollout.multi_turn.tool_timeout_s=2"))
    assert time.monotonic() - start < 900  # it used to stall for ever (0 steps in 240 s); now two steps end
    (_, first), (_, second) = trainer.history
    assert first["multi_turn/num_timeouts/create"] == 4 and first["multi_turn/num_timeouts/calc_reward"] == 4
    # Row 2's four blocking releases; a release of another row caught on a blocked loop may add one.
    assert first["multi_turn/num_timeouts/release"] >= 4
    assert first["rollout/finish_abort_frac"] == 0.5  # rows 0 and 1 (n=4 each) failed; row 2 only leaked a release
    assert second["multi_turn/num_timeouts/create"] == 4 and "multi_turn/num_timeouts/release" not in second
    assert second["rollout/finish_abort_frac"] == 0.25
    assert all(math.isfinite(v) for v in second.values())


@pytest.mark.slow
def test_two_runs_into_one_directory(assets):
    """Two real megarl-train runs into one checkpoint directory: the second refuses at once, naming the first
    run's PID; the first run is untouched and finishes with its checkpoints."""
    import subprocess
    import sys

    from megarl.controller.run_checkpoints import LOCK_NAME

    overrides = _overrides(assets, "shared", *ONE_RANK, "trainer.total_steps=2", "trainer.save_freq=1")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "megarl.cli.train", *overrides]
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lock = assets["root"] / "shared" / "ckpt" / "megarl" / "shared" / LOCK_NAME
        deadline = time.monotonic() + 120
        while not (lock.exists() and f"pid {first.pid} " in lock.read_text()):
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took its directory"
            time.sleep(0.2)
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"in use by another run (pid {first.pid} on host" in second.stderr
        assert "Ray cluster" not in second.stdout + second.stderr  # refused before any model, data or Ray work
        assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    finally:
        first.kill()
        first.wait()
    manager = CheckpointManager(assets["root"] / "shared" / "ckpt" / "megarl" / "shared")
    assert manager.latest().name == "global_step_2" and manager.steps() == [1, 2]

    # Cut a shard of the newest checkpoint; the next run falls back to
    # step 1, saying which file of which checkpoint is damaged, instead of failing the same way on every restart.
    shard = manager.path(2) / "actor" / "dist" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert ("points to global_step_2, which is damaged: file actor/dist/__0_0.distcp has 1000 bytes where the "
            "manifest records") in rerun.stderr
    assert f"using {manager.path(1)} instead" in rerun.stderr
    assert f"resumed from {manager.path(1)} at step 1" in rerun.stdout
    assert manager.latest() == manager.path(2) and manager.steps() == [1, 2]  # step 2 saved again, whole


def test_a_failed_run_says_what_failed_in_a_few_lines(assets):
    """A run that fails after Ray started (here the reward function raises on some rows, with
    ``on_error=raise``) prints the error's own message, naming the row, and where the traceback went, instead of
    60-100 lines of traceback first; exit code 1, nothing left running. Its wandb run (offline) ends as failed."""

    from tests.tracker_files import wandb_records

    overrides = _overrides(assets, "fails", *ONE_RANK, "trainer.total_steps=1",
                           "reward_model.custom_reward_function.name=even_prompts_raise",
                           "trainer.logger=[jsonl,wandb]")
    wandb_home = assets["root"] / "fails" / "wandb_home"  # wandb's settings and caches
    run = _train_cli(overrides, WANDB_MODE="offline", WANDB_DIR=None,
                     **{key: str(wandb_home / key) for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")})
    assert run.returncode == 1, run.stderr[-3000:]
    report = run.stderr[run.stderr.index("megarl-train: step 1 failed"):]
    assert "RewardError: row " in report and "ConnectionError: judge unavailable for prompt" in report
    # The driver's own lines (Ray forwards the workers' output with a "(Class pid=N)" prefix: a worker stopped by
    # the shutdown may print a finalizer's interrupted traceback, which is not the run's report).
    driver = [line for line in run.stderr.splitlines() if not re.search(r"\(\w+ pid=\d+(, ip=\S+)?\)", line)]
    assert not [line for line in driver if "Traceback" in line], run.stderr[-3000:]
    assert "megarl reaper" not in run.stderr  # a failed run's shutdown leaves nothing behind either
    log = assets["root"] / "fails" / "runs" / "megarl" / "fails" / "error.log"
    assert f"(the whole traceback: {log})" in report and "Traceback" in log.read_text()
    (run_file,) = (log.parent / "wandb").glob("offline-run-*/run-*.wandb")
    assert [record.exit.exit_code for kind, record in wandb_records(run_file) if kind == "exit"] == [1]


def test_shared_memory_of_another_nodes_workers_is_removed_there(assets):
    """Roles.shutdown unlinks the killed workers' buffers of every other node by a task pinned to that node (the
    same code, on this one-node cluster pinned to this node): a dead process's file goes, a live one's stays."""
    import subprocess
    import sys

    from megarl.controller.build import remove_shared_memory_on_nodes
    from megarl.parallel.shared_memory import SHARED_MEMORY_DIR, shared_memory_files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    files = [SHARED_MEMORY_DIR / f"torch_{dead.pid}_1_0", SHARED_MEMORY_DIR / f"torch_{os.getpid()}_megarl_test_0"]
    for path in files:
        path.write_bytes(b"")
    try:
        node = ray.get_runtime_context().get_node_id()
        assert remove_shared_memory_on_nodes({node: [dead.pid]}) == 1
        assert shared_memory_files([dead.pid]) == [] and files[1].exists()
    finally:
        for path in files:
            path.unlink(missing_ok=True)


def test_a_full_disk_during_a_save_says_so_and_loses_nothing(assets, tmp_path):
    """A checkpoint root on a full device (a 1 MiB tmpfs; the save needs several) used to fail with
    ``CheckpointException ranks:dict_keys([])``; now the run names the device, its free space and what to do, the
    partial save is removed, exit code 1."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a full device needs a small tmpfs, and this user cannot mount one: {mounted.stderr.strip()}")
    try:
        overrides = _overrides(assets, "full", *ONE_RANK, "trainer.total_steps=1", "trainer.save_freq=1",
                               f"trainer.default_local_dir={disk}")
        run = _train_cli(overrides)
        assert run.returncode == 1, run.stderr[-3000:]
        report = run.stderr[run.stderr.index("megarl-train: step 1 failed"):]
        assert "CheckpointSaveError: checkpoint of step 1 not saved: no space left on the device of" in report, report
        assert "no earlier checkpoint exists" in report and "trainer.default_local_dir" in report
        assert "Traceback" not in run.stderr
        assert not [p for p in disk.rglob("*") if p.name.startswith(".tmp_")]  # the partial save is gone
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_an_empty_model_directory_fails_before_any_work(assets, tmp_path):
    """``megarl-train`` on an empty model directory exits 2 before Ray starts, naming the
    key and the missing files (it used to fail inside transformers with "need sentencepiece or tiktoken")."""
    import subprocess
    import sys

    empty = tmp_path / "empty_model"
    empty.mkdir()
    overrides = _overrides(assets, "empty", f"actor_rollout_ref.model.path={empty}")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "megarl.cli.train", *overrides], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"actor_rollout_ref.model.path={str(empty)!r} has no config / weights / tokenizer" in run.stderr
    assert "Traceback" not in run.stderr
    assert "Ray cluster" not in run.stdout + run.stderr  # refused before Ray


def test_an_engine_killed_before_the_weight_sync_ends_the_run_with_its_short_report(assets, tmp_path):
    """An engine server killed between the actor's update and the weight sync: the sync fails inside the actor's Ray
    worker, and the error crosses Ray whole (megarl's exceptions pickle) to megarl-train's one-screen report, which
    names the engine, its URL and the step, with the traceback in error.log."""
    import signal

    from megarl.cli.train import failure_report, run_failures
    from megarl.workers.engine_server import EngineServerWorker

    cfg = _config(assets, "sync_killed", "trainer.total_steps=1")
    trainer = Trainer(cfg, console=lambda *_: None)
    try:
        trainer.setup()
        pid = trainer.roles.rollout.call_all(EngineServerWorker.server_pid)[1]
        url = trainer.roles.engines[1].url
        sync = trainer._sync_weights

        def kill_then_sync(*args, **kwargs):
            os.kill(pid, signal.SIGKILL)
            assert not _alive_after([pid], timeout_s=60)  # a guard: SIGKILL ends it at once
            return sync(*args, **kwargs)

        trainer._sync_weights = kill_then_sync
        with pytest.raises(run_failures()) as caught:
            trainer.train_step()
    finally:
        trainer.shutdown()
    report = failure_report(caught.value, 1, tmp_path)
    lines = report.splitlines()
    assert lines[0] == "megarl-train: step 1 failed; workers and Ray stopped.", report
    assert "engine 1" in report and url in report, report
    assert len(lines) <= 22 and "Traceback" not in report, report
    assert lines[-1] == f"(the whole traceback: {tmp_path / 'error.log'})"
    assert "Traceback" in (tmp_path / "error.log").read_text()


def test_a_killed_engine_server_ends_the_step_naming_it_and_no_server_outlives_the_run(assets):
    """SIGKILL one engine server while its share of the step's generation is inside it (paused in place
    just before the requests leave, so the share waits there, on a machine of any speed; 384 tokens a row): the
    step fails with an error naming the engine and its URL (seen gone, not waited out); after shutdown no engine
    server or router process is left (checked by PID), and the run no longer holds the driver's event loop."""
    import asyncio
    import os
    import signal

    from megarl.engines.client import EngineError, run_sync
    from megarl.workers.engine_server import EngineServerWorker
    from tests.engine_servers import load, wait_for

    cfg = _config(assets, "engine_killed", "trainer.total_steps=1", "data.max_response_length=384")
    trainer = Trainer(cfg, console=lambda *_: None)
    try:
        trainer.setup()
        pids = trainer.roles.rollout.call_all(EngineServerWorker.server_pid) + [trainer.roles.router.pid]
        assert all(pid is not None for pid in pids)
        # A run on one machine serves its engines and router on loopback only.
        import psutil

        listening = {(c.laddr.ip, c.laddr.port) for pid in pids for c in psutil.Process(pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        assert listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
        # The training ranks meet through a file, not a TCP store (which listens on every interface): each rank
        # listens beyond loopback only with Ray's own worker server.
        for info in trainer.roles.actor.node_infos:
            wide = [c.laddr for c in psutil.Process(info["pid"]).net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1")]
            assert len(wide) == 1, (info, wide)
        assert trainer.roles.actor.rendezvous_file and os.path.exists(trainer.roles.actor.rendezvous_file)
        assert all(engine.url.startswith("http://127.0.0.1:") for engine in trainer.roles.engines)
        generator, manager = trainer.rollout_manager.generator, trainer.rollout_manager
        original, generate, killed = generator.generate_batch, manager.generate, []
        victim = trainer.roles.engines[1]

        def pause_then_generate(*args, **kwargs):
            run_sync(victim.pause_generation("in_place"))  # before any request leaves: engine 1 keeps its share
            return generate(*args, **kwargs)

        async def generate_then_kill(*args, **kwargs):
            request = asyncio.ensure_future(original(*args, **kwargs))
            if not killed:
                killed.append(None)
                await wait_for(victim.url, "/v1/loads", lambda answer: sum(
                    load(answer)[key] for key in ("num_waiting_reqs", "num_running_reqs")) > 0, "received its share")
                os.kill(pids[1], signal.SIGKILL)
            return await request

        manager.generate = pause_then_generate
        generator.generate_batch = generate_then_kill
        with pytest.raises(EngineError) as error:
            trainer.train_step()
        assert killed == [None]  # the kill landed while the share waited in the engine
        url = trainer.roles.engines[1].url
        assert f"generation failed: engine 1 at {url} no longer answer(s) /health" in str(error.value)
        assert error.value.engine == "engine 1" and error.value.url == url
    finally:
        trainer.shutdown()
    from megarl.engines import event_loop

    assert event_loop._holders == 1  # the run let go of the driver's event loop: only the test session holds it
    alive = _alive_after(pids, timeout_s=60)
    assert not alive, f"processes outlived the run: {alive}"


def _alive_after(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Those of ``pids`` still running once they all ended or ``timeout_s`` passed (a bound for a broken run: the
    processes are polled until gone, never waited on for a fixed time)."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _pid_alive(pid)]
        if alive:
            time.sleep(0.2)
    return alive


def _pid_alive(pid: int) -> bool:
    """Live, as the reaper counts it: a killed process that nobody waited for yet (a zombie) has ended."""
    from megarl.parallel.reaper import running

    return running(pid)


@pytest.mark.slow
def test_moe_grpo_replays_the_engines_routing(assets):
    """GRPO on a tiny Qwen3.5-MoE (a hybrid: Gated DeltaNet linear attention in three of its four layers, gated
    attention in the fourth; 8 experts, top-2 by softmax, beside a gated shared expert in every layer) at EP=2 over
    the 2 actor ranks, packed, engines in bf16 (as on GPUs): with ``router_replay.mode=replay`` the old-log-prob pass
    routes every token as the engine did (mismatch 0, measured from the routers' maps) though its routers by
    themselves would not always; with ``compare`` the training routing is its own, and differs from the rollout's.
    The replay run syncs by the ``tensor`` transport, the compare run by the ``distributed`` one. The rollout/train
    log-prob gap is logged every step (the bf16 engines' against the fp32 trainer). A run resumed from the replay
    run's step-1 checkpoint repeats its step 2 exactly."""
    from megarl.models.tiny import save_tiny

    model = save_tiny(assets["root"] / "moe_model", arch="qwen3_5_moe", seed=3)
    common = ("actor_rollout_ref.actor.parallel.tp=1", "actor_rollout_ref.actor.parallel.ep=2",
              "actor_rollout_ref.rollout.dtype=bfloat16", f"actor_rollout_ref.model.path={model}")
    replay = _run(_config(assets, "moe_replay", "trainer.total_steps=2", "trainer.save_freq=1", *common,
                          "actor_rollout_ref.actor.router_replay.mode=replay"))
    compare = _run(_config(assets, "moe_compare", "trainer.total_steps=1", *common,
                           "actor_rollout_ref.actor.router_replay.mode=compare",
                           "actor_rollout_ref.rollout.weight_transport=distributed"))
    assert (replay.roles.weight_transport, compare.roles.weight_transport) == ("tensor", "distributed")
    for trainer in (replay, compare):
        for _, metrics in trainer.history:
            assert all(math.isfinite(v) for v in metrics.values())
            assert metrics["actor/skipped_steps"] == 0
            _unverifiable(metrics)  # SGLang's Qwen3.5 reads nothing back; the replayed routing (0) is the check
            assert metrics["moe/routing_decisions"] > 0  # the rows' tokens but their last, over 4 sparse layers
            assert 0.0 < metrics["mismatch/abs_logp_diff_mean"] < 0.05  # bf16 engines, fp32 trainer
    print("rollout/train gap, mean |Δ log p| per step (bf16 engines):",
          [m["mismatch/abs_logp_diff_mean"] for _, m in replay.history + compare.history])
    for _, metrics in replay.history:
        assert metrics["moe/routing_mismatch"] == 0.0
    assert max(m["moe/router_natural_mismatch"] for _, m in replay.history) > 0.0
    (_, compared), = compare.history
    assert compared["moe/routing_mismatch"] == compared["moe/router_natural_mismatch"] > 0.0
    step1 = CheckpointManager(replay.run_dir).path(1)
    resumed = _run(_config(assets, "moe_resumed", "trainer.total_steps=2", *common,
                           "actor_rollout_ref.actor.router_replay.mode=replay", "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={step1}"))
    assert [s for s, _ in resumed.history] == [2]
    want, have = _untimed(replay.history[1][1]), _untimed(resumed.history[0][1])
    diffs = {k: (want[k], have.get(k)) for k in want if want[k] != have.get(k)}
    assert not diffs, f"step 2 differs after resume: {diffs}"


@pytest.mark.parametrize("lora_sync", ["adapters", "merged"])
def test_lora_grpo_trains_adapters_only_against_the_base_as_reference(assets, lora_sync):
    """A LoRA actor (TP=2) trains two GRPO steps; no reference model is built (the KL term is
    against the actor with its adapters off, zero at the first step, where B = 0). ``adapters``: the engines serve
    LoRA and get the adapters alone, every tensor's checksum checked by every engine rank, and generate naming the
    adapter (the engines' log-probs are the trainer's); ``merged``: they get the merged weights, every tensor read
    back equal. The checkpoint holds the adapters alone and exports to PEFT's format."""
    from megarl.convert import jobs
    from megarl.convert.dist_checkpoint import OPTIMIZER_PREFIX, read_dist_metadata
    from megarl.workers.model_checkpoint import export_source

    trainer = _run(_config(assets, f"lora_{lora_sync}", "trainer.total_steps=2", "trainer.save_freq=2",
                           "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                           "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                           f"actor_rollout_ref.rollout.lora_sync={lora_sync}",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=4"))  # one update a step
    (_, first), (_, second) = trainer.history
    from megarl.workers.megatron_workers import ActorWorker

    # No reference model: each actor rank's reference is its own model with the adapters off.
    assert trainer.roles.actor.call_all(ActorWorker.reference_model) == ["actor"] * trainer.roles.actor.world_size
    # The adapters start at B = 0: the actor is its reference (up to the rounding of other micro-batch shapes);
    # after one update they differ.
    assert abs(first["actor/kl_loss"]) < 1e-7 and second["actor/kl_loss"] > 1e-5, (first["actor/kl_loss"],
                                                                                   second["actor/kl_loss"])
    layers = 2  # the assets' tiny model
    for metrics in (first, second):
        if lora_sync == "merged":
            _unverifiable(metrics)  # merged HF tensors of a Qwen2
        else:  # A and B of q, k, v, o, gate, up and down in every layer, on each of the 2 engines
            assert metrics["weight_sync/verified_tensors"] == 2 * 7 * layers
            assert metrics["weight_sync/verified_engines"] == 2
        assert metrics["mismatch/abs_logp_diff_mean"] <= 1e-5
    if lora_sync == "merged":
        return  # the checkpoint is the same in both modes
    step = CheckpointManager(trainer.run_dir).latest()
    saved = [n for n in read_dist_metadata(step / "actor" / "dist").state_dict_metadata
             if not n.startswith(OPTIMIZER_PREFIX)]
    assert saved and all(n.endswith((".lora_A", ".lora_B")) for n in saved)
    source = export_source(step / "actor")
    assert (source.lora.rank, source.lora.alpha) == (4, 8.0)
    jobs.mcore_to_hf(source, trainer.run_dir / "peft", peft=True)
    assert (trainer.run_dir / "peft" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("layout", ["pp=2"])
def test_a_teacher_with_the_students_weights_scores_its_tokens_as_the_student_does(assets, layout):
    """A teacher (its own workers, at PP=2) given the student's own weights scores the student's (TP=1) sampled
    tokens with the same log-probs at the first step (the teacher's layout equals TP=1 within 1e-5: the per-token
    log-ratio is 0); once the student has moved, the reverse KL is what the step trains against. The teacher's
    forward is the actor's (``LogProbRole``), whose log-probs equal TP=1's at TP=2 as well
    (``tests/distributed/test_model_parallel.py``); here its own ranks, at a layout of its own, are the subject."""
    trainer = _run(_config(assets, f"teacher_{layout.replace('=', '')}", "trainer.total_steps=2",
                           "actor_rollout_ref.actor.parallel.tp=1", "teacher.enable=true",
                           f"teacher.model.path={assets['model']}", "teacher.model.dtype=float32",
                           f"teacher.parallel.{layout}", "teacher.kl_coef=0.5"))
    (_, first), (_, second) = trainer.history
    teacher = trainer.roles.plan.role("teacher")
    assert teacher.bundles == (0, 1) and (teacher.dims.tp, teacher.dims.pp) == ((2, 1) if layout == "tp=2" else (1, 2))
    assert first["teacher/abs_log_ratio_max"] <= 1e-5, first["teacher/abs_log_ratio_max"]
    assert abs(first["teacher/reverse_kl"]) <= 1e-6
    assert second["teacher/abs_log_ratio_max"] > 1e-3  # the student moved away from its teacher
    assert math.isfinite(second["teacher/reverse_kl_seq"]) and first["timing_s/teacher"] > 0


def test_a_reward_model_scores_every_response_of_a_grpo_step(assets):
    """A reward model (an HF sequence-classification checkpoint of the policy's tokenizer, its own ranks at
    TP=2) scores every response of a GRPO step; with ``combine=replace`` its scores are the step's rewards."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    directory = assets["root"] / "rm"
    if not directory.exists():
        config = AutoConfig.from_pretrained(assets["model"])
        config.architectures, config.num_labels = ["Qwen2ForSequenceClassification"], 1
        config.pad_token_id = AutoTokenizer.from_pretrained(assets["model"]).pad_token_id
        torch.manual_seed(0)
        model = Qwen2ForSequenceClassification.from_pretrained(assets["model"], config=config, dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 0.5)
        model.save_pretrained(directory)
        AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(directory)
    trainer = _run(_config(assets, "reward_model", "trainer.total_steps=1", "actor_rollout_ref.actor.parallel.tp=1",
                           "reward_model.enable=true", f"reward_model.model.path={directory}",
                           "reward_model.model.dtype=float32", "reward_model.parallel.tp=2",
                           "reward_model.micro_batch_size_per_gpu=3"))
    ((_, metrics),) = trainer.history
    assert trainer.roles.plan.role("reward_model").dims.tp == 2
    assert metrics["reward_model/score/max"] > metrics["reward_model/score/min"]  # responses scored one by one
    assert metrics["critic/score/mean"] == pytest.approx(metrics["reward_model/score/mean"], abs=1e-6)
    assert metrics["timing_s/reward_model"] > 0


@pytest.mark.slow
def test_the_tiny_vision_language_recipe_learns_to_count(tmp_path):
    """``recipe=tiny_cpu_vl_grpo`` as a user runs it (its own data: images of coloured squares written to
    data/squares/, its own SFT warm start of a tiny Qwen2.5-VL), 30 GRPO steps through the real path: image prompts
    to the engines, the images to the actor's first stage. The sampled reward rises by 0.1 or more (measured:
    0.517 over the first 5 steps, 0.698 over the last 5; greedy validation 0.745 -> 0.805), the engines' log-probs
    equal the actor's (mismatch < 1e-5) and every weight, the vision tower's too, reaches both engines."""
    run = _train_cli(["recipe=tiny_cpu_vl_grpo", f"actor_rollout_ref.model.path={tmp_path / 'tiny_vl_sft'}",
                      "actor_rollout_ref.model.init=tiny_sft",
                      "trainer.logger=[console,jsonl]", "trainer.save_freq=-1"], cwd=tmp_path, timeout_s=850)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    assert "megarl reaper" not in run.stderr  # the shutdown ended Ray's agents itself: nothing was left behind
    assert (tmp_path / "data" / "squares" / "train.parquet").is_file()
    lines = (tmp_path / "runs" / "megarl" / "tiny_cpu_vl_grpo" / "metrics.jsonl").read_text().splitlines()
    steps = [row for row in map(json.loads, lines) if "critic/score/mean" in row]
    assert len(steps) == 30
    scores = [row["critic/score/mean"] for row in steps]
    assert sum(scores[-5:]) / 5 - sum(scores[:5]) / 5 >= 0.1, scores
    assert max(row["mismatch/abs_logp_diff_mean"] for row in steps) < 1e-5
    assert all(row["weight_sync/verified_engines"] == 0 for row in steps)  # SGLang's Qwen2.5-VL reads nothing back


def test_multi_turn_rollouts_of_a_vision_language_policy(assets, tmp_path):
    """Multi-turn GRPO of a tiny Qwen2.5-VL on image prompts (a tool that answers with an image offered):
    every turn's request carries the conversation's images to the engines, and the actor recomputes the engines'
    log-probs on the conversations, images at their placeholders."""
    import yaml

    from megarl.models.tiny import save_tiny_vl
    from megarl.warmstart.squares_data import ensure_squares_data

    model = save_tiny_vl(tmp_path / "vl", seed=1, initializer_range=0.3)
    train, _ = ensure_squares_data(tmp_path / "squares", num_train=8, num_test=1)
    tools = tmp_path / "image_tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{
        "class_name": "tests.e2e.image_tool.ImageTool", "config": {},
        "tool_schema": {"type": "function", "function": {"name": "look", "description": "Shows an image.",
                                                         "parameters": {"type": "object", "properties": {}}}}}]}))
    trainer = _run(_config(assets, "vl_multi_turn", "recipe=tiny_cpu_vl_grpo", *ONE_RANK, "trainer.total_steps=1",
                           f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.init=pretrained",
                           f"data.train_files=[{train}]", "data.val_files=[]", "data.max_prompt_length=320",
                           "data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                           "actor_rollout_ref.rollout.multi_turn.format=qwen25",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                           "reward_model.custom_reward_function.path=null",
                           "reward_model.custom_reward_function.name=compute_score"))
    (_, metrics), = trainer.history
    assert all(math.isfinite(v) for v in metrics.values())
    assert "rollout/finish_abort_frac" not in metrics and metrics["response_length/mean"] > 0
    assert metrics["mismatch/abs_logp_diff_mean"] <= 1e-5
    _unverifiable(metrics, engines=1)


def test_ppo_of_a_vision_language_policy_with_a_critic_reading_the_images(assets, tmp_path):
    """PPO (GAE) on image prompts: the critic (a value head on the same vision-language model, its tower on
    its first stage) trains on the rows' images, the actor's micro-batches padded where the critic's are packed
    (multimodal positions either way), the weights reaching the engines by broadcast."""
    from megarl.models.tiny import save_tiny_vl
    from megarl.warmstart.squares_data import ensure_squares_data

    model = save_tiny_vl(tmp_path / "vl", seed=1, initializer_range=0.3)
    train, _ = ensure_squares_data(tmp_path / "squares", num_train=8, num_test=1)
    trainer = _run(_config(assets, "vl_ppo", "recipe=tiny_cpu_vl_grpo", *ONE_RANK, "trainer.total_steps=1",
                           f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.init=pretrained",
                           f"data.train_files=[{train}]", "data.val_files=[]", "algorithm.adv_estimator=gae",
                           "critic.enable=true", "critic.ppo_mini_batch_size=2",
                           "critic.ppo_micro_batch_size_per_gpu=4", "critic.forward_micro_batch_size_per_gpu=8",
                           "actor_rollout_ref.model.use_remove_padding=false",
                           "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.pool_nodes=[1]"))
    (_, metrics), = trainer.history
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["critic/vf_loss"] > 0 and metrics["critic/grad_norm"] > 0 and "actor/pg_loss" in metrics
    assert trainer.roles.weight_transport == "distributed"
    _unverifiable(metrics, engines=1)
    assert any(name.startswith("visual.") for name in trainer.roles.weight_names)
    assert metrics["mismatch/abs_logp_diff_mean"] <= 1e-5
