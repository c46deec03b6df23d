"""megarl: Megatron-Core RL trainer for LLMs (PPO, GRPO and relatives)."""

__version__ = "0.1.0"


def _no_wandb_in_worker_processes() -> None:
    """Ray's worker processes and megarl's spawned ranks never log to a tracker (the driver does), but Megatron
    imports wandb whenever it is installed, and importing wandb makes two temporary directories that a killed
    process leaves in /tmp (Ray kills every worker at a run's end). Such processes see wandb as not installed."""
    import os
    import sys

    if os.environ.get("MEGARL_WORKER_PROCESS") == "1" or os.path.basename(sys.argv[0] if sys.argv else "") == \
            "default_worker.py":
        sys.modules.setdefault("wandb", None)


_no_wandb_in_worker_processes()

from megarl import _eager_megatron  # noqa: E402

_eager_megatron.install()
