"""``megarl-generate``: responses for a file of prompts (verl's ``main_generation``).

    megarl-generate recipe=tiny_cpu_grpo generation.output_path=out.parquet
    megarl-generate actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct data.path=prompts.parquet \\
        data.n_samples=4 data.output_path=responses.parquet actor_rollout_ref.rollout.temperature=0.7

Arguments are the training run's Hydra overrides (megarl's names or verl's). The prompts come from
``data.train_files`` (verl's ``data.path``), read as training reads them; ``generation.output_path`` (verl's
``data.output_path``) receives each kept row with a ``responses`` column of ``generation.n_samples`` (verl's
``data.n_samples``; default ``actor_rollout_ref.rollout.n``) strings, sampled with the rollout's settings by the
engines of ``actor_rollout_ref.rollout`` started from ``actor_rollout_ref.model.path``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megarl.cli.train import local_ray_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megarl-generate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="+", help="Hydra overrides, e.g. recipe=tiny_cpu_grpo "
                                                     "generation.output_path=out.parquet")
    args = parser.parse_args(argv)
    local_ray_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("ray", "megatron", "torch", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from megarl.config import ConfigError, load_config

    try:
        cfg = load_config(args.overrides, generation_only=True)
    except ConfigError as error:
        print(f"megarl-generate: invalid config: {error}", file=sys.stderr)
        return 2
    from megarl.controller.generate import GenerationInputError, generate_responses
    from megarl.controller.interrupts import TERMINATED_EXIT_CODE, Terminated, terminate_as_interrupt

    terminate_as_interrupt()  # kill / scancel / docker stop: stopped as a Ctrl-C is
    try:
        generate_responses(cfg)  # every process it starts has ended when it returns or raises
    except GenerationInputError as error:
        print(f"megarl-generate: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        terminated = isinstance(interrupt, Terminated)
        print(f"megarl-generate: {'terminated (SIGTERM)' if terminated else 'interrupted'}; engines and Ray "
              f"stopped, nothing written", file=sys.stderr)
        return TERMINATED_EXIT_CODE if terminated else 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
