"""What a person watching a run sees: each long phase as it starts and ends, with its duration, and the run's
summary at its end.

Start-up is the longest silent stretch of a run (Ray, placing the workers, building the models, starting the
engine servers, the first weight sync: about 45 s on 2 CPU cores, minutes on GPUs), and so is a checkpoint save.
:class:`Phases` prints a line when each begins and one when it ends, and keeps the durations
(``Trainer.phases.seconds``). :func:`run_summary` turns a finished run's history into the lines printed at its
end.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence


class Phases:
    """Announce phases on ``console`` as they start and end; ``seconds[name]`` their durations."""

    def __init__(self, console: Callable[[str], None] = print) -> None:
        self._console = console
        self._lock = threading.Lock()  # phases may run on two threads (the engines start while the models build)
        self.seconds: dict[str, float] = {}

    def console(self, text: str) -> None:
        """One line on the console, whole even when two phases end together."""
        with self._lock:
            self._console(text)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """``with phases("starting the engine servers"):`` prints ``starting the engine servers ...`` then, when
        the block ends, ``starting the engine servers: 12.3 s`` (or that it failed after that long)."""
        self.console(f"{name} ...")
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.console(f"{name}: failed after {time.perf_counter() - start:.1f} s")
            raise
        self.seconds[name] = time.perf_counter() - start
        self.console(f"{name}: {self.seconds[name]:.1f} s")


def no_phases(name: str) -> contextlib.AbstractContextManager:
    """A :class:`Phases` stand-in that prints nothing."""
    return contextlib.nullcontext()


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def run_summary(history: Sequence[tuple[int, dict[str, float]]], validations: Sequence[tuple[int, dict[str, float]]],
                *, setup_s: float, log_dir, checkpoint, export_command: str | None) -> list[str]:
    """The lines printed when a run ends: steps, time per step, the sampled reward at the start and the end
    (mean of the first and last five steps; the reverse KL to a teacher too), each validation's ``mean@N`` first → last (the validation before
    training included), where the logs and the last checkpoint are, and how to export it for serving."""
    lines = []
    if history:
        steps = [step for step, _ in history]
        step_s = [m["timing_s/step"] for _, m in history if "timing_s/step" in m]
        lines.append(f"steps {steps[0]}-{steps[-1]} ({len(steps)} run), {_mean(step_s):.2f} s per step, "
                     f"start-up {setup_s:.1f} s")
        scores = [m["critic/score/mean"] for _, m in history if "critic/score/mean" in m]
        if scores:
            head = max(1, min(5, len(scores) // 2))
            lines.append(f"sampled reward (critic/score/mean): {_mean(scores[:head]):.3f} over the first {head} step(s) "
                         f"-> {_mean(scores[-head:]):.3f} over the last {head}")
        kls = [m["teacher/reverse_kl"] for _, m in history if "teacher/reverse_kl" in m]
        if kls:  # on-policy distillation
            head = max(1, min(5, len(kls) // 2))
            lines.append(f"reverse KL to the teacher (teacher/reverse_kl): {_mean(kls[:head]):.4f} over the first "
                         f"{head} step(s) -> {_mean(kls[-head:]):.4f} over the last {head}")
    validation: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in validations:
        for key, value in metrics.items():
            if key.startswith("val-core/") and "/mean@" in key:  # mean@N; best@k and maj@k stay in the logs
                validation.setdefault(key, []).append((step, value))
    for key, values in sorted(validation.items()):
        (first_step, first), (last_step, last) = values[0], values[-1]
        lines.append(f"{key}: {first:.3f} at step {first_step} -> {last:.3f} at step {last_step}"
                     if len(values) > 1 else f"{key}: {first:.3f} at step {first_step}")
    lines.append(f"logs: {log_dir}  (tensorboard --logdir {log_dir})")
    if checkpoint is not None:
        lines.append(f"last checkpoint: {checkpoint}")
        if export_command:
            lines.append(f"export it for serving (HF safetensors): {export_command}")
    return lines
