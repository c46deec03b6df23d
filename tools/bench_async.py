"""Benchmark: synchronous against asynchronous training, side by side in one run.

The tiny CPU recipe (``configs/recipe/tiny_cpu_grpo.yaml``) with the engines on their own resources: the actor
on one gloo rank (TP=1) and one HF engine server on its own pool (``hybrid_engine=false``), so on a 2-core
machine each side has a core. Three runs of ``--steps`` steps each, every setting equal but the mode:

- ``sync``: each step generates, then trains (the engine idles while the actor trains, and the other way round);
- ``one_step_off``: step k+1's prompts generate while step k trains (samples one weight version old);
- ``fully_async``: the engine generates ahead into the buffer (up to two weight versions ahead,
  ``async_training.max_staleness=2``; partial rollouts: a weight sync pauses the requests in flight and continues
  them with the new weights).

Reported per mode: steps per minute (steps after the first, whose time includes the first generation), the
sampled reward against wall-clock minutes, the reward's rise (mean of the last five steps minus the first five),
and the trainer's and engine's idle shares. The synchronous run's own timings give the most any overlap can
gain (``overlap_bound = step / (step - generation)``: Amdahl): on the tiny recipe generation is a small share of
a step, so the bound is low. A second, generation-bound workload (``--gen-bound-steps``; responses run to
``--gen-bound-tokens`` tokens, ``rollout.ignore_eos``) shows what the overlap gives when generation is a real
share of the step, as in RL with long responses.

    python tools/bench_async.py                        # 40 steps per mode, then 8 generation-bound ones
    python tools/bench_async.py --steps 10 --gen-bound-steps 0

Any trainer override can follow (Hydra syntax). The last line is
``RESULT async_speedup=<async steps/min ÷ sync> one_step_speedup=<x> async_reward_rise=<x> ...``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile

MODES = ("sync", "one_step_off", "fully_async")
PLACEMENT = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.pool_nodes=[1]",
             "actor_rollout_ref.actor.parallel.tp=1", "trainer.n_cpu_ranks=1"]
MODE_SETTINGS = {"sync": [], "one_step_off": [],
                 "fully_async": ["async_training.max_staleness=2", "async_training.partial_rollout=true",
                                 "async_training.pause_mode=in_place"]}
"""fully_async generates up to two weight versions ahead (``max_staleness=2``): with one, a step's groups may start
only once the previous step's sync has landed, so the engine has exactly one training step to generate the next
batch and every batch that runs a little long (the engine shares the machine with the trainer) made the trainer wait
(4-9 % of its time on the generation-bound workload); with two it never waited. It holds its requests in place
across a weight sync (their KV cache kept): ``retract`` would recompute the cache of every held row, a prefill that
on the CPU engine costs 10-20 % of a generation-bound step's decoding (the sync lands near the end of the running
batch) and left the trainer waiting; on GPUs a prefill is a few decoding steps."""


_RUNS = itertools.count()


def run_mode(mode: str, steps: int, overrides: list[str], out: str) -> list[dict[str, float]]:
    """The per-step metrics of one run of ``mode``."""
    from megarl.config import load_config
    from megarl.controller.trainer import Trainer

    name = f"bench_async_{next(_RUNS)}_{mode}"
    cfg = load_config(["recipe=tiny_cpu_grpo", f"trainer.total_steps={steps}", "trainer.save_freq=-1",
                       "trainer.test_freq=-1",
                       "trainer.val_before_train=false", "trainer.logger=[jsonl]", f"trainer.experiment_name={name}",
                       f"trainer.default_local_dir={out}/ckpt", f"trainer.log_dir={out}/runs", *PLACEMENT,
                       f"trainer.mode={mode}", *MODE_SETTINGS[mode], *overrides])
    trainer = Trainer(cfg, console=lambda *_: None)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    return [metrics for _, metrics in trainer.history]


def summarise(mode: str, history: list[dict[str, float]]) -> dict[str, float]:
    step_s = [m["timing_s/step"] for m in history]
    rewards = [m["critic/score/mean"] for m in history]
    head = min(5, len(rewards) // 2)
    out = {"steps_per_min": 60.0 * (len(step_s) - 1) / sum(step_s[1:]),
           "reward_rise": sum(rewards[-head:]) / head - sum(rewards[:head]) / head,
           "gen_s": sum(m["timing_s/gen"] for m in history[1:]) / (len(history) - 1),
           "step_s": sum(step_s[1:]) / (len(step_s) - 1)}
    if mode != "sync":
        later = history[1:]
        out["trainer_idle_frac"] = sum(m["async/trainer_idle_frac"] for m in later) / len(later)
        out["engine_idle_frac"] = sum(m["async/engine_idle_frac"] for m in later) / len(later)
        out["staleness_max"] = max(m.get("async/staleness/max", 0.0) for m in history)
    return out


def report(title: str, histories: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Print the table and the reward against wall-clock minutes; returns the summaries."""
    summaries = {mode: summarise(mode, history) for mode, history in histories.items()}
    print(f"\n== {title}")
    print(f"{'mode':<14}{'steps/min':>10}{'step s':>8}{'gen s':>8}{'reward rise':>13}{'trainer idle':>14}"
          f"{'engine idle':>13}{'max staleness':>15}")
    for mode, s in summaries.items():
        idle = (f"{s['trainer_idle_frac']:>14.2f}{s['engine_idle_frac']:>13.2f}{s['staleness_max']:>15.0f}"
                if mode != "sync" else f"{'-':>14}{'-':>13}{'-':>15}")
        print(f"{mode:<14}{s['steps_per_min']:>10.2f}{s['step_s']:>8.2f}{s['gen_s']:>8.2f}{s['reward_rise']:>+13.3f}"
              + idle)
    print("reward against wall-clock minutes (every 5th step):")
    for mode, history in histories.items():
        clock, points = 0.0, []
        for step, metrics in enumerate(history, 1):
            clock += metrics["timing_s/step"] / 60.0
            if step % 5 == 0 or step == len(history):
                points.append(f"{clock:.2f} min: {metrics['critic/score/mean']:.3f}")
        print(f"  {mode:<13}" + "  ".join(points))
    return summaries


def overlap_bound(sync: dict[str, float]) -> float:
    """The most steps/min any overlap of generation with training can give over ``sync`` (Amdahl)."""
    return sync["step_s"] / max(sync["step_s"] - sync["gen_s"], 1e-9)


GEN_BOUND = ["actor_rollout_ref.rollout.ignore_eos=true", "data.train_batch_size=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
             "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.rollout.verify_weights=0"]
"""The generation-bound workload (with ``data.max_response_length=--gen-bound-tokens``): 2 prompts × 4 samples a
step, every response ``--gen-bound-tokens`` long. Eight rows decode in about the time one row does (a decoding step
costs its kernels' overhead, not its rows), while training costs per token: few rows and long responses make
generation about half of a synchronous step. No reference model (no KL loss) and no read-back of synced weights:
the rest of the step is the actor's old log-probs, its update and the weight sync."""


def gen_share(summary: dict[str, float]) -> float:
    """Generation's share of a synchronous step."""
    return summary["gen_s"] / summary["step_s"]


def results(tiny: dict[str, dict[str, float]], bound: dict[str, dict[str, float]] | None) -> dict[str, float]:
    """The RESULT numbers from the summaries of the tiny workload and (None: skipped) the generation-bound one."""
    sync = tiny["sync"]
    result = {"async_speedup": tiny["fully_async"]["steps_per_min"] / sync["steps_per_min"],
              "one_step_speedup": tiny["one_step_off"]["steps_per_min"] / sync["steps_per_min"],
              "async_reward_rise": tiny["fully_async"]["reward_rise"],
              "one_step_reward_rise": tiny["one_step_off"]["reward_rise"],
              "sync_reward_rise": sync["reward_rise"],
              "overlap_bound": overlap_bound(sync),
              "tiny_gen_share": gen_share(sync)}
    result["async_of_bound"] = result["async_speedup"] / result["overlap_bound"]
    if bound is not None:
        base = bound["sync"]["steps_per_min"]
        result.update({"gen_bound_async_speedup": bound["fully_async"]["steps_per_min"] / base,
                       "gen_bound_one_step_speedup": bound["one_step_off"]["steps_per_min"] / base,
                       "gen_bound_overlap_bound": overlap_bound(bound["sync"]),
                       "gen_share": gen_share(bound["sync"])})
        result["gen_bound_async_of_bound"] = result["gen_bound_async_speedup"] / result["gen_bound_overlap_bound"]
    return result


def describe_bound(summary: dict[str, float], bound: float) -> str:
    share = gen_share(summary)
    line = f"generation is {share:.1%} of a synchronous step: overlap can give at most {bound:.2f}x"
    if share > 0.5:  # the engine, not the trainer, sets the pace: the ceiling is step / generation
        line += f" (generation over half the step: the ceiling is {1 / share:.2f}x)"
    return line


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per mode on the tiny recipe")
    parser.add_argument("--gen-bound-steps", type=int, default=20, help="steps per mode, generation-bound (0: skip)")
    parser.add_argument("--gen-bound-tokens", type=int, default=256, help="response tokens, generation-bound")
    parser.add_argument("overrides", nargs="*", help="trainer overrides (Hydra syntax)")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be >= 10 (reward rise: the first five steps against the last five)")
    if args.gen_bound_steps and args.gen_bound_steps < 3:
        parser.error("--gen-bound-steps must be 0 (skip) or >= 3 (the first step, which generates ahead, is left out)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = tempfile.mkdtemp(prefix="megarl_bench_async_")

    tiny = report(f"tiny recipe, {args.steps} steps per mode (actor TP=1 on one rank, one engine on its own pool)",
                  {mode: run_mode(mode, args.steps, args.overrides, out) for mode in MODES})
    print(describe_bound(tiny["sync"], overlap_bound(tiny["sync"])))
    bound = None
    if args.gen_bound_steps:
        heavy = [f"data.max_response_length={args.gen_bound_tokens}", *GEN_BOUND, *args.overrides]
        bound = report(f"generation-bound: 2 prompts x 4 samples of {args.gen_bound_tokens} tokens a step, "
                       f"{args.gen_bound_steps} steps per mode",
                       {mode: run_mode(mode, args.gen_bound_steps, heavy, out) for mode in MODES})
        print(describe_bound(bound["sync"], overlap_bound(bound["sync"])))
    result = results(tiny, bound)
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
