"""Compose a :class:`RunConfig` from ``configs/`` and command-line overrides with Hydra's compose API.

``configs/config.yaml`` lists the schema (:data:`megarl.config.schema.SCHEMA_NAME`) first, so
every YAML value and override is merged into the typed dataclasses: an unknown key or a value
of the wrong type fails at composition, and the error names the key (and the nearest declared ones).

Overrides may use verl's names: :func:`megarl.config.verl_keys.translate` rewrites them into megarl's
before Hydra composes (docs/verl_migration.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.checks import validate
from megarl.config.keys import did_you_mean, is_declared
from megarl.config.schema import RunConfig, register_schema
from megarl.config.verl_keys import VerlKeyError, check_equal, translate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
"""The repository's ``configs/`` directory (Hydra YAML: ``config.yaml`` and its groups)."""


class ConfigError(ValueError):
    """A config that cannot be composed or built; the message names the key to change."""


def compose_config(overrides: Sequence[str] = (), *, config_dir: str | Path = CONFIG_DIR,
                   config_name: str = "config") -> DictConfig:
    """The composed, typed (schema-backed) OmegaConf tree of ``config_name`` with ``overrides`` (in megarl's or
    verl's names) applied."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register_schema()
    try:
        translation = translate(overrides)
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
            cfg = compose(config_name=config_name, overrides=pretrained_when_path_given(translation.overrides))
        check_equal(cfg, translation.equal)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(_describe(error) + _nearest(error)) from error
    except VerlKeyError as error:
        raise ConfigError(str(error)) from error
    return cfg


MODEL = "actor_rollout_ref.model"


def pretrained_when_path_given(overrides: Sequence[str]) -> list[str]:
    """An override of a model's ``path`` (the policy's, the teacher's, the reward model's) names a model to load:
    without an override of its ``init`` it adds ``<section>.init=pretrained``, so a recipe's tiny warm start
    (``init: tiny_sft`` or ``tiny_rm``) never writes over that path."""
    keys = {override.lstrip("+~").split("=", 1)[0].strip() for override in overrides}
    added = [f"{section}.init=pretrained" for section in (MODEL, "teacher.model", "reward_model.model")
             if f"{section}.path" in keys and f"{section}.init" not in keys]
    return [*overrides, *added]


def load_config(overrides: Sequence[str] = (), *, config_dir: str | Path = CONFIG_DIR,
                config_name: str = "config", generation_only: bool = False) -> RunConfig:
    """Compose ``configs/<config_name>.yaml`` with ``overrides`` (e.g. ``["recipe=qwen2_5_7b_grpo",
    "trainer.total_steps=10"]``) and return the typed :class:`RunConfig`.

    Each section's own checks run while the dataclasses are built, then the cross-component checks
    (:func:`megarl.config.checks.validate`), once: the returned config is ready to run.
    ``generation_only`` (``megarl-generate``): only the checks of what generation uses (the machines and the
    engines), not those of training (batches, algorithm, roles).
    Raises :class:`ConfigError` (a ``ValueError``) naming the offending key.
    """
    cfg = to_run_config(compose_config(overrides, config_dir=config_dir, config_name=config_name))
    try:
        validate(cfg, generation_only=generation_only)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    return cfg


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Build the dataclasses of a composed tree; a section's ``ValueError`` is re-raised with its full key."""
    _check_known_keys(cfg, "")
    try:
        tree = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException:  # a broken interpolation: building the dataclasses names it
        tree = OmegaConf.to_container(cfg, resolve=False)
    _refuse_nan(tree, "")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{' and '.join(missing)} must be set (the base config names no model or data): set "
                          f"{'them' if len(missing) > 1 else 'it'}, or choose a recipe that does (recipe=<name> of "
                          f"configs/recipe/; recipe=tiny_cpu_grpo is the tiny CPU job)")
    try:
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as error:
        raise ConfigError(_describe(error)) from error
    except ValueError as error:
        key = _failing_section(cfg, "")
        raise ConfigError(f"{key}: {error}" if key else str(error)) from error
    if not isinstance(run, RunConfig):
        raise ConfigError(f"the composed config is a {type(run).__name__}, not a RunConfig: configs/config.yaml must "
                          f"list the schema first in its defaults")
    return run


def _refuse_nan(node: Any, key: str) -> None:
    """Refuse a NaN anywhere in the tree, naming its key: every comparison with NaN is false, so a check such as
    ``value <= 0`` lets it through (``engine_timeout_s=nan`` turned the frozen-engine watch off; ``lora_alpha=nan`` and
    ``kl_loss_coef=nan`` trained nothing to rc 0). No setting means anything by NaN."""
    if isinstance(node, float) and math.isnan(node):
        raise ConfigError(f"{key}=nan: set a number")
    if isinstance(node, dict):
        for name, value in node.items():
            _refuse_nan(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            _refuse_nan(value, f"{key}[{index}]")


def _check_known_keys(node: DictConfig, key: str) -> None:
    """Refuse keys a dataclass section does not declare (``+key=value`` overrides bypass the schema)."""
    object_type = OmegaConf.get_type(node)
    declared = None
    if object_type is not None and dataclasses.is_dataclass(object_type):
        declared = {field.name for field in dataclasses.fields(object_type)}
    for child_key in node:
        full_key = f"{key}.{child_key}" if key else str(child_key)
        if declared is not None and child_key not in declared:
            near = did_you_mean(str(child_key), declared)
            raise ConfigError(f"{full_key} is not a setting of {object_type.__name__}{near}; its settings are "
                              f"{sorted(declared)} (check the spelling in the recipe or the override)")
        if OmegaConf.is_missing(node, child_key):
            continue  # building the dataclasses names it (to_run_config)
        child = node[child_key]
        if isinstance(child, DictConfig):
            _check_known_keys(child, full_key)


def _failing_section(node: DictConfig, key: str) -> str:
    """Full key of the deepest dataclass section of ``node`` whose construction raises ``ValueError``."""
    for child_key in node:
        child = node[child_key]
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) is not dict:
            found = _failing_section(child, f"{key}.{child_key}" if key else str(child_key))
            if found:
                return found
    object_type = OmegaConf.get_type(node)
    if key and object_type is not None and dataclasses.is_dataclass(object_type):
        try:
            OmegaConf.to_object(node)
        except ValueError:
            return key
    return ""


def _nearest(error: Exception) -> str:
    """``"\n(did you mean ...?)"`` for an unknown key in a recipe (OmegaConf's error carries its full key)."""
    while error is not None:
        key = getattr(error, "full_key", None)
        if key and not is_declared(key):
            near = did_you_mean(key)
            return f"\n{near.strip()}" if near else ""
        error = error.__cause__ or error.__context__
    return ""


def _describe(error: Exception) -> str:
    """Hydra's and OmegaConf's message, with the innermost cause (which names the key) appended."""
    messages = [str(error).strip()]
    cause = error.__cause__ or error.__context__
    while cause is not None:
        text = str(cause).strip()
        if text and text not in messages[-1] and "$VALUE" not in text:
            messages.append(text)
        cause = cause.__cause__ or cause.__context__
    return "\n".join(messages)
