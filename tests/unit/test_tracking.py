"""Metric sinks: logged validation samples (``trainer.log_val_generations``) reach jsonl, TensorBoard and the
console; the hosted trackers (wandb offline, mlflow to a local store, swanlab offline) write each step's metrics,
read back from their files."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.controller.tracking import Tracking
from megarl.controller.tracking_backends import MetricNames, backend_metric_name, missing_logger_packages
from tests.tracker_files import leveldb_records, wandb_records


def test_log_generations_writes_every_sink(tmp_path):
    lines = []
    tracker = Tracking(["console", "tensorboard", "jsonl"], tmp_path, console=lines.append)
    samples = [{"input": "What is 2 + 3?", "output": "5", "score": 1.0},
               {"input": "a | b\nc", "output": "x", "score": 0.0}]
    tracker.log_generations(samples, step=7)
    tracker.log_generations([], step=8)  # nothing to log: nothing written
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert rows == [{"step": 7, "tag": "val/generations", **s} for s in samples]
    assert lines == ["step 7 val/generations: 'What is 2 + 3?' -> '5' (score 1)",
                     "step 7 val/generations: 'a | b\\nc' -> 'x' (score 0)"]
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("val/generations/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 7 and "| What is 2 + 3? | 5 | 1 |" in table and "a \\| b<br>c" in table


# ------------------------------------------------------------------ the hosted trackers (trainer.logger)
STEPS = {1: {"actor/pg_loss": 0.5, "val/acc/mean@4": 0.25, "done": True, "note": "not a number"},
         2: {"actor/pg_loss": -1.25, "val/acc/mean@4": 0.75},
         3: {"actor/pg_loss": 2.0, "val/acc/mean@4": 1.0}}
"""Logged per step; the bool and the string are no scalars: no sink gets them."""
SAMPLES = [{"input": "What is 2 + 3?", "output": "5", "score": 1.0}]


def run_config(tmp_path, logger: str):
    from megarl.config import load_config

    return load_config(["recipe=tiny_cpu_grpo", f"trainer.logger=[console,{logger}]", "trainer.project_name=proj",
                        "trainer.experiment_name=exp", f"trainer.log_dir={tmp_path}"])


def log_steps(cfg, *, failed: bool = False) -> None:
    """What a run does with its tracker: build it as the trainer does, log the steps and a validation's samples,
    close it."""
    tracker = Tracking.for_run(cfg, console=lambda line: None)
    for step, metrics in STEPS.items():
        tracker.log(metrics, step=step)
    tracker.log_generations(SAMPLES, step=3)
    tracker.close(failed=failed)
    tracker.close()  # a second close does nothing


def expected_history(name: str) -> list[tuple[int, float]]:
    return [(step, metrics[name]) for step, metrics in STEPS.items()]


def test_trainer_logger_takes_verls_names_and_refuses_others():
    from megarl.config import ConfigError, load_config

    cfg = load_config(["recipe=tiny_cpu_grpo", "trainer.logger=[console,tensorboard,jsonl,wandb,mlflow,swanlab]"])
    assert cfg.trainer.logger == ["console", "tensorboard", "jsonl", "wandb", "mlflow", "swanlab"]
    with pytest.raises(ConfigError, match="trainer.logger"):
        load_config(["recipe=tiny_cpu_grpo", "trainer.logger=[console,neptune]"])


def test_a_missing_tracker_package_names_its_extra(tmp_path, monkeypatch):
    from megarl.config import load_config
    from megarl.controller.run_inputs import check_run_inputs

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        None if name in ("wandb", "swanlab", "sqlalchemy") else real_find_spec(name, *a)))
    assert missing_logger_packages(["console", "jsonl"]) is None
    with pytest.raises(ValueError, match=re.escape("wandb needs wandb; swanlab needs swanlab, not installed here: "
                                                   "pip install 'megarl[wandb,swanlab]'")):
        check_run_inputs(load_config(["recipe=tiny_cpu_grpo", "trainer.logger=[console,wandb,swanlab]"]))  # before Ray starts
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default store, in SQLite: SQLAlchemy's
    assert "mlflow needs sqlalchemy, not installed here" in missing_logger_packages(["mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking-server:5000")  # mlflow-skinny alone will do
    assert missing_logger_packages(["mlflow"]) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'megarl[wandb]'")):
        Tracking(["jsonl", "wandb"], tmp_path)


def test_metric_names_a_backend_refuses_are_renamed_deterministically(caplog):
    assert backend_metric_name("val/acc/mean@4", "mlflow") == "val/acc/mean_at_4"  # verl's mapping
    assert backend_metric_name("a/b c:d-e.f_g", "mlflow") == "a/b c:d-e.f_g"  # accepted as it is
    assert backend_metric_name("x[0]/y%/z", "mlflow") == "x_0_/y_/z"
    assert backend_metric_name("/a//b/./c/..", "mlflow") == "_/a/_/b/_/c/_"
    assert backend_metric_name("a" * 300, "mlflow") == "a" * 250
    assert backend_metric_name("/val/x@4\n.", "swanlab") == "_val/x@4__"
    assert backend_metric_name("val/x@4", "swanlab") == "val/x@4"
    for name in ("val/acc/mean@4", "x[0]", "a b"):
        assert backend_metric_name(name, "wandb") == name
    names = MetricNames("mlflow")
    with caplog.at_level("WARNING", logger="megarl.train"):
        assert names.rename({"a@b": 1.0, "a_at_b": 2.0}) == {"a_at_b": 2.0}
        names.rename({"a@b": 1.0, "a_at_b": 2.0})
    assert [r.getMessage() for r in caplog.records] == [
        "metrics 'a@b' and 'a_at_b' are both logged to mlflow as 'a_at_b' (mlflow refuses their names as they "
        "are): one overwrites the other"]


def test_wandb_offline_writes_the_step_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # in the test extra
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "home" / key))  # nothing written to the home directory
    cfg = run_config(tmp_path, "wandb")
    log_steps(cfg)
    (run_file,) = (tmp_path / "proj" / "exp" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, runs, exits = {}, {}, [], []
    for kind, record in wandb_records(run_file):
        if kind == "history":
            row = nested(record.history.item)
            for key, value in row.items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((row["_step"], value))
        elif kind == "run":
            runs.append((record.run.project, record.run.display_name))
            config.update(nested(record.run.config.update))
        elif kind == "exit":
            exits.append(record.exit.exit_code)
    assert runs[0] == ("proj", "exp") and exits == [0]
    assert config["trainer"]["experiment_name"] == "exp" and config["trainer"]["logger"] == ["console", "wandb"]
    assert history["actor/pg_loss"] == expected_history("actor/pg_loss")
    assert history["val/acc/mean@4"] == expected_history("val/acc/mean@4")  # wandb takes the name as it is
    assert set(history) == {"actor/pg_loss", "val/acc/mean@4", "val/generations"}
    ((step, table),) = history["val/generations"]
    assert step == 3 and table["_type"] == "table-file"
    rows = json.loads((run_file.parent / "files" / table["path"]).read_text())
    assert rows["columns"] == ["step", "input", "output", "score"]
    assert rows["data"] == [[3, SAMPLES[0]["input"], SAMPLES[0]["output"], SAMPLES[0]["score"]]]


def nested(items) -> dict:
    """wandb's history or config items (a key path and a JSON value each) as a nested dict."""
    row: dict = {}
    for item in items:
        *parents, last = list(item.nested_key) or [item.key]
        target = row
        for key in parents:
            target = target.setdefault(key, {})
        target[last] = json.loads(item.value_json)
    return row


def test_mlflow_writes_the_step_metrics_under_the_log_dir(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")  # in the test extra
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    cfg = run_config(tmp_path / "logs", "mlflow")
    log_steps(cfg)
    log_steps(cfg, failed=True)  # a second run of the project; its training failed
    assert not any((tmp_path / "cwd").iterdir())  # the store is under trainer.log_dir, whatever the directory
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'logs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("proj")
    runs = sorted(client.search_runs([experiment.experiment_id]), key=lambda run: run.info.start_time)
    assert [(run.info.run_name, run.info.status) for run in runs] == [("exp", "FINISHED"), ("exp", "FAILED")]
    run_id = runs[0].info.run_id
    for name, mapped in (("actor/pg_loss", "actor/pg_loss"), ("val/acc/mean@4", "val/acc/mean_at_4")):
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, mapped)] == expected_history(name)
    assert set(runs[0].data.metrics) == {"actor/pg_loss", "val/acc/mean_at_4"}
    params = runs[0].data.params
    assert params["trainer.experiment_name"] == "exp" and params["trainer.logger"] == '["console", "mlflow"]'
    assert params["actor_rollout_ref.actor.optim.betas"] == "[0.9, 0.999]"
    artifact = tmp_path / "logs" / "mlartifacts" / run_id / "artifacts" / "val" / "generations" / "step_3.json"
    assert json.loads(artifact.read_text()) == [{"step": 3, **SAMPLES[0]}]


def test_swanlab_offline_writes_the_step_metrics(tmp_path, monkeypatch):
    pytest.importorskip("swanlab")  # in the test extra
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "home"))  # swanlab's settings folder
    log_steps(run_config(tmp_path, "swanlab"))
    (run_file,) = (tmp_path / "proj" / "exp" / "swanlog").glob("run-*/run-*.swanlab")
    history, starts, finishes, media = {}, [], [], []
    for data in leveldb_records(run_file, b":SWL"):
        record = Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "scalar":
            history.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
        elif kind == "start":
            starts.append((record.start.project, record.start.name))
        elif kind == "finish":
            finishes.append(record.finish.state)
        elif kind == "media":
            media.append((record.media.key, record.media.step))
    assert starts == [("proj", "exp")] and len(finishes) == 1
    assert media == [("val/generations", 3)]  # the samples' table
    assert history == {"actor/pg_loss": expected_history("actor/pg_loss"),
                       "val/acc/mean@4": expected_history("val/acc/mean@4")}
    (config,) = (tmp_path / "proj" / "exp" / "swanlog").glob("run-*/files/config.yaml")
    assert "experiment_name" in config.read_text()


def test_a_hosted_tracker_that_cannot_start_is_refused_before_ray(tmp_path, monkeypatch):
    """wandb online without a key, and a wandb or MLflow server that does not answer, are refused by the run's
    input check, saying what to set (they used to stall 109 s and 254 s, then end in a traceback); an offline wandb
    and MLflow's own SQLite store need nothing; a server that listens passes."""
    import socket

    from megarl.controller.tracking_backends import unreachable_trackers

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: a connection is refused at once
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    assert unreachable_trackers(["console", "jsonl", "tensorboard", "mlflow"]) is None  # SQLite under log_dir
    assert "no wandb API key is set (WANDB_API_KEY, or `wandb login`)" in unreachable_trackers(["wandb"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert unreachable_trackers(["wandb"]) is None
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "netrc").write_text(f"machine 127.0.0.1 login user password {'k' * 40}\n")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port}")
    assert f"its server http://127.0.0.1:{closed_port} cannot be reached (ConnectionRefusedError" in \
        unreachable_trackers(["wandb"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port}")
    assert f"MLFLOW_TRACKING_URI=http://127.0.0.1:{closed_port} cannot be reached" in unreachable_trackers(["mlflow"])
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("WANDB_BASE_URL", url)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        assert unreachable_trackers(["wandb", "mlflow"]) is None
    from megarl.config import load_config
    from megarl.controller.run_inputs import check_run_inputs

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port}")
    with pytest.raises(ValueError, match="trainer.logger has mlflow, and MLFLOW_TRACKING_URI="):
        check_run_inputs(load_config(["recipe=tiny_cpu_grpo", "trainer.logger=[console,mlflow]"]))
