"""``megarl-train``: compose the config (Hydra) and run the trainer.

    megarl-train                                   # no arguments: the tiny CPU recipe (recipe=tiny_cpu_grpo)
    megarl-train recipe=qwen2_5_7b_grpo trainer.total_steps=10
    megarl-train --print-config recipe=llama3_1_70b_grpo
    megarl-train actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct ...   # verl's overrides (docs/verl_migration.md)

Arguments are Hydra overrides (``key=value``, ``recipe=<name>``), in megarl's names or verl's. Without a
recipe the base config is a GPU run like verl's (configs/config.yaml). The run prints each start-up phase with its
duration and ends with a summary: steps, time per step, reward at the start and the end, validation, where the
logs and the last checkpoint are and how to export it.
"""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_RUN = ("recipe=tiny_cpu_grpo",)
"""What ``megarl-train`` runs without arguments: the tiny CPU recipe (the README's first command)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megarl-train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. recipe=qwen2_5_7b_grpo trainer.total_steps=10")
    parser.add_argument("--print-config", action="store_true", help="print the composed config and exit")
    args = parser.parse_args(argv)
    if not args.overrides:
        print(f"megarl-train: no overrides: the tiny CPU job ({DEFAULT_RUN[0]})", file=sys.stderr)
        args.overrides = list(DEFAULT_RUN)
    local_ray_settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("ray", "megatron", "torch", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from omegaconf import OmegaConf

    from megarl.config import ConfigError, load_config

    try:
        cfg = load_config(args.overrides)  # composed, built and validated
    except ConfigError as error:
        print(f"megarl-train: invalid config: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0

    from megarl.controller.interrupts import TERMINATED_EXIT_CODE, Terminated, terminate_as_interrupt
    from megarl.controller.run_checkpoints import RunDirectoryInUse
    from megarl.controller.trainer import RunInputError, Trainer

    terminate_as_interrupt()  # kill / scancel / docker stop: stopped as a Ctrl-C is
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    except (RunDirectoryInUse, RunInputError) as error:
        print(f"megarl-train: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        trainer.shutdown()
        terminated = isinstance(interrupt, Terminated)
        print(f"megarl-train: {'terminated (SIGTERM)' if terminated else 'interrupted'} at step "
              f"{trainer.global_step}; workers and Ray stopped", file=sys.stderr)
        return TERMINATED_EXIT_CODE if terminated else 130
    except run_failures() as error:  # the run names what failed: that, not pages of traceback
        trainer.shutdown()
        failed_step = getattr(error, "step", trainer.global_step + 1)  # a checkpoint's failure names its step
        print(failure_report(error, failed_step, trainer.log_dir), file=sys.stderr)
        return 1
    finally:
        trainer.shutdown()
    print("\n".join(["run finished:", *(f"  {line}" for line in trainer.summary())]))
    if trainer.last_checkpoint is None:
        print(f"  no checkpoint written (trainer.save_freq={cfg.trainer.save_freq}); root {trainer.run_dir}")
    return 0


def local_ray_settings() -> None:
    """A run that starts its own Ray cluster (no ``RAY_ADDRESS``) uses Ray's token authentication with a fresh
    token, unless ``RAY_AUTH_MODE`` says otherwise (the token lives only in this process's environment and those of
    the processes Ray starts, written nowhere). Ray reads the mode when it is imported: call this first. (The
    cluster listens on loopback: ``megarl.controller.build.ray_on_loopback``.)"""
    import os
    import secrets

    if "RAY_ADDRESS" not in os.environ and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"] = "token", secrets.token_hex(32)


def run_failures() -> tuple[type[BaseException], ...]:
    """Failures whose message names the part that failed (a worker's role and rank, an engine and its URL, a
    reward row, the share of failed rollouts, a server that did not start, a checkpoint that could not be written, a
    judge's answers)."""
    from megarl.controller.judge import JudgeError
    from megarl.controller.metrics import RolloutFailureError
    from megarl.controller.run_checkpoints import CheckpointSaveError
    from megarl.engines.client import EngineError
    from megarl.engines.server_process import ServerStartError
    from megarl.reward.manager import RewardError
    from megarl.workers.group import WorkerError

    return WorkerError, EngineError, RewardError, RolloutFailureError, ServerStartError, CheckpointSaveError, JudgeError


def failure_report(error: BaseException, step: int, log_dir, max_lines: int = 20) -> str:
    """What ``megarl-train`` prints when the run fails: the error's own message (its first ``max_lines`` lines),
    and where the whole traceback went (``<log_dir>/error.log``)."""
    import traceback
    from pathlib import Path

    path = Path(log_dir) / "error.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(error)))
    lines = f"{type(error).__name__}: {error}".splitlines()
    shown = "\n".join(lines[:max_lines]) + ("\n..." if len(lines) > max_lines else "")
    return f"megarl-train: step {step} failed; workers and Ray stopped.\n{shown}\n(the whole traceback: {path})"


if __name__ == "__main__":
    sys.exit(main())
