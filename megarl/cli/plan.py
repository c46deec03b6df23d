"""``megarl-plan``: the pre-flight plan of a run, without a GPU.

    megarl-plan recipe=llama3_1_70b_grpo
    megarl-plan recipe=qwen2_5_7b_grpo actor_rollout_ref.actor.parallel.tp=4 trainer.gpu_memory_gb=40
    megarl-plan recipe=qwen3_30b_a3b_grpo actor_rollout_ref.actor.parallel.ep=4

Arguments are the Hydra overrides ``megarl-train`` takes. Prints the placement (which GPUs hold
which actor/ref/critic ranks and engines, the TP/PP/DP groups, for mixture-of-experts models the
EP/ETP groups), the memory per kind of GPU in each phase against ``trainer.gpu_memory_gb``, the
weight-sync volume and, for mixture-of-experts models, the all-to-all volume. Exit status 0 when the
run fits, 2 when the config does not factor or does not fit (the message names the keys to change).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megarl-plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. recipe=llama3_1_70b_grpo")
    args = parser.parse_args(argv)

    from megarl.config import ConfigError, load_config
    from megarl.plan.preflight import plan_run

    try:
        plan = plan_run(load_config(args.overrides), check=False)
    except (ConfigError, ValueError) as error:
        print(f"megarl-plan: invalid config: {error}", file=sys.stderr)
        return 2
    print(plan.report())
    problems = plan.problems()
    if problems:
        print("megarl-plan: does not fit: " + "\n".join(problems), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
