"""The hosted experiment trackers of ``trainer.logger``: ``wandb``, ``mlflow`` and ``swanlab`` (verl's names).

Each is an optional extra (``pip install 'megarl[wandb]'``, ``megarl[mlflow]``, ``megarl[swanlab]``), imported
only when the run chooses it; a missing package is refused before Ray starts
(:func:`missing_logger_packages`, run by :func:`megarl.controller.run_inputs.check_run_inputs`), naming the extra.
Every backend gets the project (``trainer.project_name``), the run's name (``trainer.experiment_name``), the
whole config, each step's scalar metrics with ``step=`` and the logged validation samples; :meth:`close` ends the
run, as failed when the training failed.

- wandb: ``wandb.init(project, name, config, dir)``; ``dir`` is ``$WANDB_DIR`` or the run's log directory
  (``<trainer.log_dir>/<project>/<experiment>/wandb/``). wandb reads ``WANDB_MODE`` itself: ``offline`` writes
  the run there without network (``wandb sync`` uploads it later). Samples: a ``val/generations`` table
  (columns step, input, output, score) per validation.
- mlflow: the tracking URI is ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<trainer.log_dir>/mlflow.db`` with
  artifacts in ``<trainer.log_dir>/mlartifacts`` (nothing written to the working directory; view with
  ``mlflow ui --backend-store-uri sqlite:///<trainer.log_dir>/mlflow.db``). The project is the MLflow
  experiment, ``experiment_name`` the run's name; the config is the run's params, one per leaf, named by its
  override key (``actor_rollout_ref.rollout.n``; lists as JSON; values cut at MLflow's 6000 characters).
  Samples: a ``val/generations/step_<k>.json`` artifact.
- swanlab: ``swanlab.init(project, experiment_name, config, logdir)``; ``logdir`` is ``$SWANLAB_LOG_DIR`` or
  ``<run's log directory>/swanlog``. swanlab reads ``SWANLAB_MODE`` (``offline``: local files only;
  ``local`` needs ``swanlab[dashboard]``) and ``SWANLAB_API_KEY`` itself. Samples: a ``val/generations``
  ECharts table.

Metric names a backend refuses are renamed the same way every time (:func:`backend_metric_name`): for MLflow
``@`` becomes ``_at_`` (verl's choice: ``val/acc/mean@4`` → ``val/acc/mean_at_4``), every other character
outside letters, digits and ``_ - . : / space`` becomes ``_``, an empty, ``.`` or ``..`` path segment becomes
``_`` and the name is cut at 250 characters; for swanlab control characters and leading or trailing
``' ', '.', '/'`` become ``_`` and the name is cut at 512. wandb, TensorBoard and jsonl take every name as it
is. Two metrics renamed to one name are warned about, once: one overwrites the other there.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import time
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("megarl.train")

BACKEND_MODULES = {"wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}
"""``trainer.logger`` name → the module it imports; each is also the name of megarl's extra that installs it."""

MLFLOW_PARAM_VALUE_LIMIT = 6000
MLFLOW_KEY_LIMIT = 250
SWANLAB_KEY_LIMIT = 512


REACH_TIMEOUT_S = 5.0
"""How long the check before Ray waits for a hosted tracker's server (wandb stalled 109 s and mlflow 254 s on an
unreachable one, then failed with a traceback)."""


def unreachable_trackers(loggers: Sequence[str], timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why a chosen hosted tracker cannot start (wandb online without an API key; wandb's or an HTTP MLflow
    server that does not answer a connection within ``timeout_s``), saying what to set; else None. Offline modes and
    file stores need nothing."""
    problems = []
    if "wandb" in loggers and os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun"):
        base = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
        if not (os.environ.get("WANDB_API_KEY") or _netrc_password(base)):
            problems.append("trainer.logger has wandb, and no wandb API key is set (WANDB_API_KEY, or `wandb login`): "
                            "set one, or WANDB_MODE=offline to write the run locally (`wandb sync` uploads it later)")
        elif (why := _unreachable(base, timeout_s)) is not None:
            problems.append(f"trainer.logger has wandb, and its server {base} cannot be reached ({why}): check the "
                            f"network or WANDB_BASE_URL, or set WANDB_MODE=offline")
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in loggers and uri.startswith(("http://", "https://")):
        if (why := _unreachable(uri, timeout_s)) is not None:
            problems.append(f"trainer.logger has mlflow, and MLFLOW_TRACKING_URI={uri} cannot be reached ({why}): "
                            f"start the server or unset MLFLOW_TRACKING_URI (the run's own SQLite store under "
                            f"trainer.log_dir)")
    return "; ".join(problems) or None


def _netrc_password(url: str) -> str | None:
    """The ``~/.netrc`` (or ``$NETRC``) password for ``url``'s host: where ``wandb login`` keeps the key."""
    import netrc
    from urllib.parse import urlsplit

    try:
        entry = netrc.netrc(os.environ.get("NETRC") or None).authenticators(urlsplit(url).hostname or "")
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry else None


def _unreachable(url: str, timeout_s: float) -> str | None:
    """Why no TCP connection to ``url``'s host and port opens within ``timeout_s``; None when one does."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return None
    except OSError as error:
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def missing_logger_packages(loggers: Sequence[str]) -> str | None:
    """Why the chosen loggers cannot run here (packages they import are not installed), naming the extras to
    install; else None."""
    missing = {name: [module for module in required_modules(name) if importlib.util.find_spec(module) is None]
               for name in loggers if name in BACKEND_MODULES}
    missing = {name: modules for name, modules in missing.items() if modules}
    if not missing:
        return None
    needs = "; ".join(f"{name} needs {', '.join(modules)}" for name, modules in missing.items())
    return (f"trainer.logger={list(loggers)}: {needs}, not installed here: pip install "
            f"'megarl[{','.join(missing)}]' (or drop {', '.join(missing)} from trainer.logger)")


def required_modules(name: str) -> tuple[str, ...]:
    """What logger ``name`` imports: MLflow with a database store (megarl's default, or a database
    ``MLFLOW_TRACKING_URI``) also needs SQLAlchemy and alembic, which mlflow-skinny leaves out."""
    if name == "mlflow":
        scheme = (os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:").split(":", 1)[0].split("+", 1)[0]
        if scheme in ("sqlite", "postgresql", "mysql", "mssql"):
            return ("mlflow", "sqlalchemy", "alembic")
    return (BACKEND_MODULES[name],)


def import_backend(name: str):
    """The module of logger ``name``, or an ImportError naming the extra to install."""
    try:
        return importlib.import_module(BACKEND_MODULES[name])
    except ImportError as error:
        raise ImportError(f"trainer.logger={name} needs the {BACKEND_MODULES[name]} package: "
                          f"pip install 'megarl[{name}]' ({error})") from error


def backend_metric_name(name: str, backend: str) -> str:
    """``name`` as ``backend`` accepts it (the module's docstring lists the rules); unchanged when accepted."""
    if backend == "mlflow":
        key = re.sub(r"[^/\w.\- :]", "_", name.replace("@", "_at_"))
        key = "/".join("_" if part in ("", ".", "..") else part for part in key.split("/"))
        return key[:MLFLOW_KEY_LIMIT]
    if backend == "swanlab":
        key = "".join("_" if unicodedata.category(c) == "Cc" else c for c in name)
        body = key.strip(" ./")
        start = len(key) - len(key.lstrip(" ./"))
        key = "_" * start + body + "_" * (len(key) - start - len(body))
        return key[:SWANLAB_KEY_LIMIT] or "_"
    return name


class MetricNames:
    """Per backend, each metric's name as the backend accepts it; warns once about two names renamed to one."""

    def __init__(self, backend: str):
        self.backend = backend
        self._names: dict[str, str] = {}
        self._owner: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        mapped = self._names.get(name)
        if mapped is None:
            mapped = self._names[name] = backend_metric_name(name, self.backend)
            owner = self._owner.setdefault(mapped, name)
            if owner != name:
                logger.warning("metrics %r and %r are both logged to %s as %r (%s refuses their names as they "
                               "are): one overwrites the other", owner, name, self.backend, mapped, self.backend)
        return mapped

    def rename(self, scalars: Mapping[str, float]) -> dict[str, float]:
        return {self(key): value for key, value in scalars.items()}


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b.c": leaf}`` (override keys); lists stay leaves."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _samples_rows(samples: Sequence[Mapping[str, Any]], step: int) -> list[list[Any]]:
    return [[step, str(s["input"]), str(s["output"]), float(s["score"])] for s in samples]


SAMPLE_COLUMNS = ["step", "input", "output", "score"]


class WandbBackend:
    def __init__(self, *, project: str, experiment: str, config: Mapping[str, Any], log_dir: Path):
        self.wandb = import_backend("wandb")
        directory = Path(os.environ.get("WANDB_DIR") or log_dir).expanduser()
        directory.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project=project, name=experiment, config=dict(config), dir=str(directory))

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, tag: str) -> None:
        table = self.wandb.Table(columns=SAMPLE_COLUMNS, data=_samples_rows(samples, step))
        self.run.log({tag: table}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before wandb's service has written the run's file (an offline run read right after
        # missed records in 6 of 12 tries on 2 busy cores); teardown stops the service, the file complete.
        self.wandb.teardown()


class MlflowBackend:
    def __init__(self, *, project: str, experiment: str, config: Mapping[str, Any], root_dir: Path):
        import_backend("mlflow")
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:  # the default: under trainer.log_dir, nothing in the working directory
            root_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{root_dir.resolve() / 'mlflow.db'}"
            artifacts = (root_dir.resolve() / "mlartifacts").as_uri()
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(project)
        if found is None:
            try:
                experiment_id = self.client.create_experiment(project, artifact_location=artifacts)
            except MlflowException:  # another run created it meanwhile
                experiment_id = self.client.get_experiment_by_name(project).experiment_id
        else:
            experiment_id = found.experiment_id
        self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        self.names = MetricNames("mlflow")
        params = [Param(self.names(key), _param_value(value)) for key, value in flatten_config(config).items()]
        self.client.log_batch(self.run_id, params=params)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(self.names(k), v, now, step) for k, v in scalars.items()])

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, tag: str) -> None:
        rows = [dict(zip(SAMPLE_COLUMNS, row)) for row in _samples_rows(samples, step)]
        self.client.log_text(self.run_id, json.dumps(rows, ensure_ascii=False, indent=1), f"{tag}/step_{step}.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:MLFLOW_PARAM_VALUE_LIMIT]


class SwanlabBackend:
    def __init__(self, *, project: str, experiment: str, config: Mapping[str, Any], log_dir: Path):
        self.swanlab = import_backend("swanlab")
        directory = Path(os.environ.get("SWANLAB_LOG_DIR") or log_dir / "swanlog").expanduser()
        directory.mkdir(parents=True, exist_ok=True)
        self.swanlab.init(project=project, experiment_name=experiment, config=dict(config), logdir=str(directory))
        self.names = MetricNames("swanlab")

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.swanlab.log(self.names.rename(scalars), step=step)

    def log_generations(self, samples: Sequence[Mapping[str, Any]], step: int, tag: str) -> None:
        table = self.swanlab.echarts.Table()
        table.add(headers=SAMPLE_COLUMNS, rows=_samples_rows(samples, step))
        self.swanlab.log({tag: table}, step=step)

    def close(self, failed: bool) -> None:
        if failed:
            self.swanlab.finish(state="crashed", error="the training run failed")
        else:
            self.swanlab.finish()


def open_backend(name: str, *, project: str, experiment: str, config: Mapping[str, Any], log_dir: Path,
                 root_dir: Path):
    """Start logger ``name``'s run (``wandb``, ``mlflow`` or ``swanlab``)."""
    if name == "wandb":
        return WandbBackend(project=project, experiment=experiment, config=config, log_dir=log_dir)
    if name == "mlflow":
        return MlflowBackend(project=project, experiment=experiment, config=config, root_dir=root_dir)
    if name == "swanlab":
        return SwanlabBackend(project=project, experiment=experiment, config=config, log_dir=log_dir)
    raise ValueError(f"unknown hosted logger {name!r}; known: {sorted(BACKEND_MODULES)}")
