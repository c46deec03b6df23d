"""Rule scorers chosen by a row's ``data_source``, and custom reward functions named by path.

Two callable shapes meet here:

- a **scorer** scores one response of a known task:
  ``scorer(solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict``;
  a :class:`ScorerRegistry` maps ``data_source`` to a scorer.
- a **compute-score function** (verl's signature) scores a response of any task:
  ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict``.
  A registry is one (:meth:`ScorerRegistry.compute_score`); a custom one is loaded with
  :func:`load_function` from ``"module_or_path:function"``.

A returned dict must hold ``"score"``; its other keys travel along as per-row extra info.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import numbers
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from megarl.reward import addition, geometry, gsm8k, hendrycks_math, math_dapo, prime_math, search_qa, squares

Scorer = Callable[..., float | dict]
"""``scorer(solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict``."""

ComputeScore = Callable[..., float | dict]
"""``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict``."""

PREFIX = "*"
"""A registered name ending in ``*`` scores every ``data_source`` that starts with what comes before it."""

BUILTIN_SCORERS: Mapping[str, Scorer] = MappingProxyType({
    gsm8k.DATA_SOURCE: gsm8k.score_response,
    addition.DATA_SOURCE: addition.score_response,
    squares.DATA_SOURCE: squares.score_response,
    **dict.fromkeys(hendrycks_math.DATA_SOURCES, hendrycks_math.score_response),
    **dict.fromkeys(math_dapo.DATA_SOURCES, math_dapo.score_response),
    **{prefix + PREFIX: math_dapo.score_response for prefix in math_dapo.DATA_SOURCE_PREFIXES},
    **dict.fromkeys(prime_math.DATA_SOURCES, prime_math.score_response),
    **dict.fromkeys(geometry.DATA_SOURCES, geometry.score_response),
    **dict.fromkeys(search_qa.DATA_SOURCES, search_qa.score_response),
})
"""The scorers every :class:`ScorerRegistry` starts with, by ``data_source`` (verl's ``default_compute_score``
table, docs/training.md "Rewards"); ``"aime*"`` stands for every ``data_source`` starting with ``aime``."""


class ScorerRegistry:
    """``data_source`` -> scorer, starting from :data:`BUILTIN_SCORERS`.

    A name ending in ``*`` (``"aime*"``) is a prefix: it scores every ``data_source`` starting with the rest
    that has no scorer of its own (the longest prefix wins).

    Each registry is its own object (no module-level state): register extra tasks on the
    registry you hand to the reward manager.
    """

    def __init__(self, scorers: Mapping[str, Scorer] | None = None) -> None:
        self._scorers: dict[str, Scorer] = dict(BUILTIN_SCORERS)
        for data_source, scorer in (scorers or {}).items():
            self.register(data_source, scorer, overwrite=True)

    def register(self, data_source: str, scorer: Scorer, *, overwrite: bool = False, **scorer_kwargs: Any) -> None:
        """Score rows of ``data_source`` with ``scorer`` (``scorer_kwargs`` bound to every call).

        Re-registering a name raises ``ValueError`` unless ``overwrite=True``; to only change
        the settings of a registered scorer use :meth:`configure`.
        """
        if not callable(scorer):
            raise TypeError(f"scorer for data_source {data_source!r} must be callable, got {type(scorer).__name__}")
        if data_source in self._scorers and not overwrite:
            raise ValueError(f"data_source {data_source!r} already has a scorer; pass overwrite=True to replace it")
        self._scorers[data_source] = functools.partial(scorer, **scorer_kwargs) if scorer_kwargs else scorer

    def configure(self, data_source: str, **scorer_kwargs: Any) -> None:
        """Bind ``scorer_kwargs`` (e.g. ``method="flexible"``) to the registered scorer's calls."""
        self._scorers[data_source] = functools.partial(self.get(data_source), **scorer_kwargs)

    def get(self, data_source: str) -> Scorer:
        """The scorer of ``data_source`` (its own, else its longest registered prefix's); ``ValueError`` naming
        the registered ones if none."""
        scorer = self._find(data_source)
        if scorer is None:
            raise ValueError(f"no reward scorer is registered for data_source {data_source!r}; registered: "
                             f"{sorted(self._scorers)}. Register one on the ScorerRegistry, or set a custom "
                             f"reward function 'module_or_path:function'")
        return scorer

    def _find(self, data_source: object) -> Scorer | None:
        if not isinstance(data_source, str):
            return None
        if data_source in self._scorers:
            return self._scorers[data_source]
        prefixes = [name for name in self._scorers
                    if name.endswith(PREFIX) and data_source.startswith(name[:-len(PREFIX)])]
        return self._scorers[max(prefixes, key=len)] if prefixes else None

    def names(self) -> list[str]:
        """Registered ``data_source`` names, sorted."""
        return sorted(self._scorers)

    def __contains__(self, data_source: object) -> bool:
        """Whether ``data_source`` has a scorer (its own or a prefix's)."""
        return self._find(data_source) is not None

    def compute_score(self, data_source: str, solution_str: str, ground_truth: Any,
                      extra_info: dict | None = None) -> float | dict:
        """Score with the scorer registered for ``data_source`` (verl's compute-score signature)."""
        return self.get(data_source)(solution_str, ground_truth, extra_info)


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None, **scorer_kwargs: Any) -> float | dict:
    """Score with the built-in scorer of ``data_source``; for custom functions to fall back on."""
    return ScorerRegistry().get(data_source)(solution_str, ground_truth, extra_info, **scorer_kwargs)


def _module_from_file(path: Path, spec_text: str) -> Any:
    """Import the Python file ``path`` under a name unique to its resolved location."""
    if not path.is_file():
        raise FileNotFoundError(f"custom reward function {spec_text!r}: file {str(path)!r} does not exist "
                                f"(relative paths are taken from {str(Path.cwd())!r})")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    name = f"megarl_custom_reward_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom reward function {spec_text!r}: {str(path)!r} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, so the module's own pickling and dataclasses find it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _module_from_name(module_name: str, spec_text: str) -> Any:
    """Import the dotted module ``module_name``, naming the spec when it does not exist."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Only a missing target module is the user's naming mistake; a missing import inside
        # an existing module propagates as it is.
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise
        raise ValueError(f"custom reward function {spec_text!r}: module {module_name!r} cannot be imported "
                         f"({err}); give a dotted module on the Python path or a path to a .py file") from err


def load_function(spec: str, **bound_kwargs: Any) -> Callable[..., Any]:
    """The function named by ``"module_or_path:function"``, with ``bound_kwargs`` bound.

    The part before the last ``:`` is a dotted module (``my_pkg.rewards``) or a Python file
    (``rewards/my_reward.py``, absolute or relative to the working directory); the part after
    it is a callable in that module. Errors name what is missing: a malformed spec, a file or
    module that does not exist, or a function the module does not define (listing those it does).
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"custom reward function {spec!r} must look like 'module_or_path:function', e.g. "
                         f"'my_pkg.rewards:compute_score' or 'rewards/my_reward.py:compute_score'")
    location, _, function_name = spec.rpartition(":")
    if not location or not function_name.isidentifier():
        raise ValueError(f"custom reward function {spec!r} must look like 'module_or_path:function' with a "
                         f"function name after the last ':'")
    if location.endswith(".py") or "/" in location or "\\" in location:
        module = _module_from_file(Path(location).expanduser(), spec)
    else:
        module = _module_from_name(location, spec)
    if not hasattr(module, function_name):
        available = sorted(name for name, value in vars(module).items()
                           if callable(value) and not name.startswith("_"))
        raise ValueError(f"custom reward function {spec!r}: {location!r} defines no {function_name!r}; "
                         f"its public callables are {available}")
    function = getattr(module, function_name)
    if not callable(function):
        raise TypeError(f"custom reward function {spec!r}: {function_name!r} is a {type(function).__name__}, "
                        f"not a function")
    return functools.partial(function, **bound_kwargs) if bound_kwargs else function


SCORE_TYPES = (int, float, numbers.Real, dict, Mapping, torch.Tensor)
"""Return annotations a compute-score function may carry (a number, or a dict with ``"score"``)."""


def check_compute_score(function: Callable[..., Any], what: str, bound_kwargs: Mapping[str, Any]) -> None:
    """Refuse, when loading, a function verl's call cannot reach or whose return annotation is not a score
    (``what`` names it in the error).

    The call is ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **bound_kwargs)``;
    the return annotation (when there is one) must be a number or a dict type (or a union of them).
    """
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no introspectable signature (a C function): checked when called
        return
    try:
        signature.bind(data_source="", solution_str="", ground_truth=None, extra_info={}, **bound_kwargs)
    except TypeError as error:
        bound = "".join(f", {key}=..." for key in bound_kwargs)
        raise ValueError(f"{what} cannot be called as fn(data_source=..., solution_str=..., "
                         f"ground_truth=..., extra_info=...{bound}) ({error}); its signature is {signature}") from None
    try:
        returns = typing.get_type_hints(function).get("return", inspect.Signature.empty)
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate says nothing about the value
        return
    if returns is inspect.Signature.empty or _is_score_type(returns):
        return
    raise ValueError(f"{what} is annotated to return {returns!r}; a reward function "
                     f"returns a float or a dict with 'score'")


def _is_score_type(annotation: Any) -> bool:
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return all(_is_score_type(arg) for arg in typing.get_args(annotation))
    target = origin if origin is not None else annotation
    return isinstance(target, type) and issubclass(target, SCORE_TYPES)
