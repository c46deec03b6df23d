"""Benchmark: where a training step's time goes, at the tiny recipe's batch (benchmarks.md, "controller overhead").

Runs the tiny CPU recipe (``configs/recipe/tiny_cpu_grpo.yaml``: actor TP=2 on 2 gloo ranks,
reference in the actor's processes, HF engines) for ``--steps`` steps through the real
trainer and reports, averaged over the steps after the first (warm-up):

- per stage, the driver's wall time (``timing_s/<stage>``: gen, reward, old_log_prob, ref,
  adv, update_actor, update_weights);
- worker compute (``perf/busy_s/<role>``: the busiest rank of each role, time inside the
  worker methods) and the **controller overhead**: the step's wall time minus worker
  compute, i.e. serialisation, Ray dispatch, the batch bookkeeping, rewards and advantages
  on the driver. Its reference is the step itself (bar: ≤ 5 %).

Any trainer override can follow (Hydra syntax), e.g. ``data.train_batch_size=32``. Without
``actor_rollout_ref.model.path``/``init`` overrides the recipe's tiny SFT warm start is used
(built and cached on first use). The last line is ``RESULT name=value ...``.

    python tools/bench_step.py
    python tools/bench_step.py --steps 6 data.train_batch_size=32
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (the first is not averaged)")
    parser.add_argument("overrides", nargs="*", help="trainer overrides (Hydra syntax)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from megarl.config import load_config
    from megarl.controller.trainer import Trainer

    out = tempfile.mkdtemp(prefix="megarl_bench_step_")
    overrides = ["recipe=tiny_cpu_grpo", f"trainer.total_steps={args.steps}", "trainer.save_freq=-1",
                 "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}/ckpt",
                 f"trainer.log_dir={out}/runs", *args.overrides]
    cfg = load_config(overrides)
    trainer = Trainer(cfg, console=lambda *_: None)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    steps = [m for _, m in trainer.history[1:]]

    def mean(key: str) -> float:
        values = [m[key] for m in steps if key in m]
        return sum(values) / len(values) if values else 0.0

    step_s = mean("timing_s/step")
    result = {"step_s": step_s, "controller_overhead_frac": mean("perf/controller_overhead_frac"),
              "controller_overhead_s": mean("perf/controller_overhead_s")}
    print(f"{'stage':<16}{'seconds':>10}{'share':>9}")
    for stage in STAGES:
        seconds = mean(f"timing_s/{stage}")
        if seconds:
            result[f"{stage}_s"] = seconds
            print(f"{stage:<16}{seconds:>10.3f}{seconds / step_s:>9.1%}")
    for role in ("actor", "critic", "rollout"):
        seconds = mean(f"perf/busy_s/{role}")
        if seconds:
            result[f"busy_{role}_s"] = seconds
            print(f"{'busy ' + role:<16}{seconds:>10.3f}{seconds / step_s:>9.1%}")
    print(f"{'overhead':<16}{result['controller_overhead_s']:>10.3f}{result['controller_overhead_frac']:>9.1%}")
    print(f"trajectories/step={cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n} steps averaged={len(steps)}")
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
