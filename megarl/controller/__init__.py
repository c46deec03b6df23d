"""The single controller: the step loop (``Trainer``, loaded on first use), the building of a run's roles on the
placement :mod:`megarl.plan` decides, run checkpoints, metrics and tracking."""

__all__ = ["Trainer"]


def __getattr__(name: str):
    if name == "Trainer":  # on first use: the trainer imports every layer below it
        from megarl.controller.trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
