"""Every exception megarl defines crosses a process boundary intact: a Ray worker's error reaches the driver
pickled, and one that cannot be rebuilt becomes Ray's ``UnserializableException``, naming nothing (an engine killed
during a weight sync ended a run in 112 lines of it)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import warnings

import pytest

import megarl

SAMPLES = {"str": "x", "int": 3, "float": 1.5, "bool": True, "int | None": 4, "float | None": 2.5,
           "str | None": "y"}
"""A value of each annotation the exceptions' ``__init__`` parameters use."""


def _exception_classes() -> list[type[BaseException]]:
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in pkgutil.walk_packages(megarl.__path__, "megarl."):
            if module.name.startswith("megarl.engines.cpu_engine.__main__"):
                continue
            for obj in vars(importlib.import_module(module.name)).values():
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("megarl")):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[name] for name in sorted(found)]


CLASSES = _exception_classes()


def _instance(cls: type[BaseException]) -> BaseException:
    if "__init__" not in vars(cls) and not any("__init__" in vars(base) for base in cls.__mro__[1:]
                                                if base.__module__.startswith("megarl")):
        return cls("what failed, and what to do")
    args, kwargs = [], {}
    for name, param in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        value = "what failed" if name == "message" else SAMPLES[str(param.annotation)]
        if param.kind is param.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    return cls(*args, **kwargs)


def test_the_walk_finds_the_exceptions_with_fields():
    names = {cls.__name__ for cls in CLASSES}
    assert {"EngineError", "WorkerError", "CheckpointSaveError", "HookTimeout", "JudgeError", "ConfigError"} <= names
    assert len(CLASSES) >= 20


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_exception_round_trips_through_pickle(cls):
    error = _instance(cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)


def test_a_judges_failure_is_a_run_failure_with_its_short_report(tmp_path):
    """``megarl-train`` ends a run that a known failure stopped with one screen (the error's message, where the
    traceback went) instead of a traceback; a judge whose answers cannot be read is one of them."""
    from megarl.cli.train import failure_report, run_failures
    from megarl.controller.judge import JudgeError

    assert JudgeError in run_failures()
    try:
        raise JudgeError("judge at http://127.0.0.1:1: the judge could not score 8 of 8 rows")
    except JudgeError as error:
        report = failure_report(error, 3, tmp_path)
    assert report.splitlines()[:2] == ["megarl-train: step 3 failed; workers and Ray stopped.",
                                       "JudgeError: judge at http://127.0.0.1:1: the judge could not score 8 of 8 rows"]
    assert "Traceback" in (tmp_path / "error.log").read_text()
