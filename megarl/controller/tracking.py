"""Metric sinks (``trainer.logger``): the console, TensorBoard, jsonl, and the hosted trackers wandb, mlflow and
swanlab (:mod:`megarl.controller.tracking_backends`: each an optional extra, imported only when chosen); plus
rollout dumps.

Logs go to ``<trainer.log_dir>/<project_name>/<experiment_name>/``: TensorBoard event files,
``metrics.jsonl``, wandb's ``wandb/`` and swanlab's ``swanlog/`` (MLflow's default store is
``<trainer.log_dir>/mlflow.db``). Rollout dumps (``trainer.rollout_data_dir``) are one
``<step>.jsonl`` per step with the decoded prompt, response, score and the reward's extra
information per trajectory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megarl.controller.tracking_backends import BACKEND_MODULES, open_backend

logger = logging.getLogger("megarl.train")

CONSOLE_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
                "actor/grad_norm", "critic/vf_loss", "teacher/reverse_kl", "mismatch/abs_logp_diff_mean",
                "response_length/mean",
                "weight_sync/seconds", "timing_s/step")


class Tracking:
    """Logs a dict of scalar metrics per step to every configured sink.

    ``log_dir`` is the run's log directory; ``root_dir`` (default ``log_dir``) is ``trainer.log_dir``, where
    MLflow's default store goes. ``project`` and ``experiment`` name the run in the hosted trackers, which get
    ``config`` (a dataclass such as :class:`~megarl.config.schema.RunConfig`, or a mapping) as the run's config.
    :meth:`close` ends every sink; ``close(failed=True)`` marks the hosted runs failed.
    """

    def __init__(self, loggers: Sequence[str], log_dir: str | os.PathLike, *, console=print,
                 project: str = "megarl", experiment: str = "default", config: Any = None,
                 root_dir: str | os.PathLike | None = None):
        self.loggers = list(loggers)
        self.log_dir = Path(log_dir).expanduser()
        self.console = console
        self._writer = None
        self._jsonl = None
        self._backends: dict[str, Any] = {}
        try:
            self._open_sinks(project, experiment, _config_dict(config),
                             Path(root_dir).expanduser() if root_dir is not None else self.log_dir)
        except BaseException:
            self.close(failed=True)
            raise

    @classmethod
    def for_run(cls, cfg: Any, *, console=print) -> Tracking:
        """The run's sinks as ``cfg.trainer`` (a :class:`~megarl.config.schema.RunConfig`'s) configures them:
        logs in ``<log_dir>/<project_name>/<experiment_name>``, the whole config to the hosted trackers."""
        trainer = cfg.trainer
        root = Path(trainer.log_dir).expanduser()
        return cls(trainer.logger, run_log_dir(trainer), console=console, project=trainer.project_name,
                   experiment=trainer.experiment_name, config=cfg, root_dir=root)

    def _open_sinks(self, project: str, experiment: str, config: dict[str, Any], root_dir: Path) -> None:
        if "tensorboard" in self.loggers or "jsonl" in self.loggers:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        if "jsonl" in self.loggers:
            self._jsonl = open(self.log_dir / "metrics.jsonl", "a", encoding="utf-8")
        for name in self.loggers:
            if name in BACKEND_MODULES:
                self._backends[name] = open_backend(name, project=project, experiment=experiment, config=config,
                                                    log_dir=self.log_dir, root_dir=root_dir)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, global_step=step)
            self._writer.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **{k: _json_number(v) for k, v in scalars.items()}}) + "\n")
            self._jsonl.flush()
        for backend in self._backends.values():
            backend.log(scalars, step)
        if "console" in self.loggers:
            shown = [f"{k.split('/', 1)[-1] if k.startswith('critic/score') else k}={scalars[k]:.4g}"
                     for k in CONSOLE_KEYS if k in scalars]
            shown += [f"{k}={scalars[k]:.4g}" for k in sorted(scalars) if k.startswith("val-core/") and "/mean@" in k]
            self.console(f"step {step}: " + "  ".join(shown))

    def log_histograms(self, values: dict[str, Any], step: int) -> None:
        """One TensorBoard histogram per key (e.g. ``async/staleness``: a value per sample); other sinks get the
        scalar summaries the step's metrics already carry."""
        if self._writer is not None:
            for key, tensor in values.items():
                if len(tensor):
                    self._writer.add_histogram(key, tensor, global_step=step)
            self._writer.flush()

    def log_generations(self, samples: Sequence[dict[str, Any]], step: int, *, tag: str = "val/generations") -> None:
        """Log decoded samples (``input``, ``output``, ``score`` per sample; ``trainer.log_val_generations``):
        a text table in TensorBoard, one ``generations.jsonl`` line per sample, the console, a table in wandb and
        swanlab, a json artifact in MLflow."""
        if not samples:
            return
        for backend in self._backends.values():
            backend.log_generations(samples, step, tag)
        if self._writer is not None:
            header = "| input | output | score |\n|---|---|---|\n"
            rows = "".join(f"| {_cell(s['input'])} | {_cell(s['output'])} | {float(s['score']):.4g} |\n" for s in samples)
            self._writer.add_text(tag, header + rows, global_step=step)
            self._writer.flush()
        if "jsonl" in self.loggers:
            with open(self.log_dir / "generations.jsonl", "a", encoding="utf-8") as f:
                for sample in samples:
                    f.write(json.dumps({"step": step, "tag": tag, **{k: _plain(v) for k, v in sample.items()}},
                                       ensure_ascii=False) + "\n")
        if "console" in self.loggers:
            for sample in samples:
                self.console(f"step {step} {tag}: {sample['input']!r} -> {sample['output']!r} "
                             f"(score {float(sample['score']):.4g})")

    def close(self, *, failed: bool = False) -> None:
        """End every sink (a second call does nothing); the hosted runs end as failed with ``failed``. Every sink
        is closed even if one raises; the first error is raised after, unless ``failed`` (then it is logged: the
        run's own error is the one to see)."""
        closers = [(name, backend.close, (failed,)) for name, backend in self._backends.items()]
        closers += [(name, sink.close, ()) for name, sink in (("tensorboard", self._writer), ("jsonl", self._jsonl))
                    if sink is not None]
        self._writer = self._jsonl = None
        self._backends = {}
        errors = []
        for name, close, args in closers:
            try:
                close(*args)
            except Exception as error:  # the others still close
                logger.exception("closing the %s logger failed", name)
                errors.append(error)
        if errors and not failed:
            raise errors[0]


def run_log_dir(trainer: Any) -> Path:
    """``<trainer.log_dir>/<project_name>/<experiment_name>``: where a run's logs go."""
    return Path(trainer.log_dir).expanduser() / trainer.project_name / trainer.experiment_name


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"Tracking(config=...) takes a dataclass or a mapping, not {type(config).__name__}")


def _cell(text: str) -> str:
    """``text`` as one markdown table cell (pipes escaped, newlines as <br>)."""
    return str(text).replace("|", "\\|").replace("\n", "<br>")


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def dump_generations(directory: str | os.PathLike, step: int, *, prompts: list[str], responses: list[str],
                     scores: list[float], extra: dict[str, list] | None = None) -> Path:
    """Write one jsonl line per trajectory to ``<directory>/<step>.jsonl``; returns the path."""
    path = Path(directory).expanduser() / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = extra or {}
    with open(path, "w", encoding="utf-8") as f:
        for i, (prompt, response, score) in enumerate(zip(prompts, responses, scores, strict=True)):
            row = {"step": step, "input": prompt, "output": response, "score": score}
            row.update({k: _plain(v[i]) for k, v in extra.items() if len(v) == len(prompts)})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)
