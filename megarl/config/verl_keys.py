"""verl's setting names, accepted as what they are: the one table from verl's keys to megarl's.

:func:`translate` rewrites command-line overrides before Hydra composes them. Every verl key megarl knows is one
entry of :data:`VERL_KEYS` (or, for a family of keys, :data:`VERL_PREFIXES`); ``docs/verl_migration.md`` is the
same table for people. An entry is one of:

- :class:`Rename`: the setting exists here under another name (``actor_rollout_ref.actor.megatron.
  tensor_model_parallel_size`` → ``actor_rollout_ref.actor.parallel.tp``), its value converted where the meaning
  needs it (verl's ``lr_warmup_steps=-1``, "use the ratio", is 0 steps here);
- :class:`Fixed`: megarl always does what one value (or a few) of the verl setting says: those are accepted,
  any other is refused saying why;
- :class:`Equal`: the setting must equal one megarl already has (the reference model shares the actor's
  Megatron layout): checked once the config is composed (:func:`check_equal`);
- :class:`Ignored`: a knob of verl's engines or kernels with no effect on what megarl computes (vLLM's
  scheduler, Megatron fusions megarl chooses itself): accepted, and listed in one warning line with the reason.

A key that is neither megarl's nor in the table is refused, with the nearest keys ("did you mean"). Hydra's
``+key`` / ``++key`` forms are accepted for every key megarl declares. When the overrides use any verl-only name,
verl's defaults that follow another setting follow it here too (:data:`VERL_FOLLOWS`: e.g. the reference's and the
engines' log-prob micro-batching follow ``actor.use_dynamic_bsz``), and ``critic.enable`` follows
``algorithm.adv_estimator`` as verl's ``critic.enable: null`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from megarl.algo.advantages import uses_critic
from megarl.config.keys import declared_keys, did_you_mean, is_declared
from megarl.config.rollout import FOREIGN_ENGINES

logger = logging.getLogger(__name__)

ARR = "actor_rollout_ref"
ACTOR, REF, ROLLOUT, MODEL = f"{ARR}.actor", f"{ARR}.ref", f"{ARR}.rollout", f"{ARR}.model"


class VerlKeyError(ValueError):
    """A verl setting megarl refuses (its message says why and what to set instead)."""


@dataclasses.dataclass(frozen=True)
class Rename:
    """verl's key is megarl's ``key``; ``convert(raw_text, value) -> raw_text`` where the value's meaning differs."""

    key: str
    convert: Callable[[str, Any], str] | None = None


@dataclasses.dataclass(frozen=True)
class Fixed:
    """megarl always does what ``values`` say: they are accepted (and change nothing), any other value is refused."""

    values: tuple
    why: str


@dataclasses.dataclass(frozen=True)
class Equal:
    """The value must equal megarl's ``key`` in the composed config."""

    key: str
    why: str


@dataclasses.dataclass(frozen=True)
class Ignored:
    """No effect on what megarl computes: accepted and listed in the warning line, with ``why``."""

    why: str


Entry = Rename | Fixed | Equal | Ignored


def _as_list(raw: str, value: Any) -> str:
    """verl's ``data.train_files`` may be one path: a list of it here."""
    return raw if isinstance(value, list) or value is None else f"[{raw}]"


def _warmup_steps(raw: str, value: Any) -> str:
    """verl's ``lr_warmup_steps=-1`` means "use ``lr_warmup_steps_ratio``" (default 0): no warm-up."""
    return "0" if isinstance(value, int) and value < 0 else raw


def _engine(raw: str, value: Any) -> str:
    if value in FOREIGN_ENGINES:
        raise VerlKeyError(f"{ROLLOUT}.name={value}: {FOREIGN_ENGINES[value]}")
    return raw


def _sanity_check_mode(raw: str, value: Any) -> str:
    return {"disable": "off"}.get(value, raw)


_LAYOUT = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
           "virtual_pipeline_model_parallel_size": "vpp", "context_parallel_size": "cp",
           "expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "etp",
           "sequence_parallel": "sequence_parallel"}
"""verl's ``<role>.megatron.*`` layout keys → megarl's ``<role>.parallel.*``."""
_OFFLOAD = ("param_offload", "grad_offload", "optimizer_offload")
_DIST_CKPT = Fixed((False,), "megarl loads the Hugging Face weights of model.path into Megatron itself (each rank "
                             "reads its slices); a Megatron checkpoint loads through trainer.resume_from_path, or "
                             "convert one to HF first with megarl-convert mcore-to-hf")
_BRIDGE = Ignored("megarl converts HF <-> Megatron weights with its own bridge (megarl.convert)")
_REF_TRANSFORMER = Ignored("the reference model is built with the actor's Megatron settings "
                           f"({ACTOR}.megatron.override_transformer_config)")
_CRITIC_RECOMPUTE = Ignored("megarl's critic keeps its activations (no recomputation setting)")
_VLLM_SCHEDULER = Ignored("an engine scheduler knob (vLLM's); SGLang schedules and chunks prefills itself")


def _role_entries(verl: str, megarl: str) -> dict[str, Entry]:
    """The Megatron role ``verl`` (``actor_rollout_ref.actor``, ``critic``): layout, offload, optimizer."""
    entries: dict[str, Entry] = {f"{verl}.megatron.{k}": Rename(f"{megarl}.parallel.{v}") for k, v in _LAYOUT.items()}
    entries |= {f"{verl}.megatron.{k}": Rename(f"{megarl}.{k}") for k in _OFFLOAD}
    entries |= {
        f"{verl}.megatron.use_dist_checkpointing": _DIST_CKPT,
        f"{verl}.megatron.use_mbridge": _BRIDGE,
        f"{verl}.megatron.use_distributed_optimizer": Rename(f"{megarl}.optim.use_distributed_optimizer"),
        f"{verl}.megatron.override_transformer_config.recompute_granularity":
            Rename(f"{megarl}.recompute_granularity") if verl != "critic" else _CRITIC_RECOMPUTE,
        f"{verl}.megatron.override_transformer_config.recompute_num_layers":
            Rename(f"{megarl}.recompute_num_layers") if verl != "critic" else _CRITIC_RECOMPUTE,
        f"{verl}.megatron.override_transformer_config.num_layers_in_first_pipeline_stage":
            Rename(f"{megarl}.parallel.first_stage_layers"),
        f"{verl}.megatron.override_transformer_config.num_layers_in_last_pipeline_stage":
            Rename(f"{megarl}.parallel.last_stage_layers"),
        f"{verl}.megatron.override_transformer_config.recompute_method":
            Fixed((None, "uniform"), "megarl recomputes uniform blocks of recompute_num_layers layers"),
        f"{verl}.optim.lr_warmup_steps": Rename(f"{megarl}.optim.warmup_steps", _warmup_steps),
        f"{verl}.optim.lr_warmup_steps_ratio": Fixed((0, 0.0), f"megarl counts the warm-up in optimizer steps: set "
                                                                f"{verl}.optim.lr_warmup_steps instead"),
        f"{verl}.optim.lr_decay_style": Rename(f"{megarl}.optim.decay_style"),
        f"{verl}.optim.lr_decay_steps": Rename(f"{megarl}.optim.decay_steps"),
        f"{verl}.optim.lr_warmup_init": Fixed((0, 0.0), "megarl's warm-up starts from a learning rate of 0"),
        f"{verl}.optim.optimizer": Fixed(("adam",), "megarl trains with Adam(W) (Megatron's adam)"),
    }
    return entries


VERL_KEYS: dict[str, Entry] = {
    **_role_entries(ACTOR, ACTOR),
    **_role_entries("critic", "critic"),
    **{f"{REF}.megatron.{k}": Equal(f"{ACTOR}.parallel.{v}", "megarl's reference model lives on the actor's ranks "
                                    "with the actor's Megatron layout") for k, v in _LAYOUT.items()},
    f"{REF}.megatron.param_offload": Rename(f"{REF}.param_offload"),
    f"{REF}.megatron.use_dist_checkpointing": _DIST_CKPT,
    f"{REF}.megatron.use_mbridge": _BRIDGE,
    f"{ACTOR}.policy_loss.loss_mode": Rename(f"{ACTOR}.policy_loss_mode"),
    f"{MODEL}.use_fused_kernels": Ignored("verl's fused log-prob/entropy kernels; megarl computes log-probs and "
                                          "entropy vocabulary-parallel (megarl.parallel.logprob)"),
    f"{MODEL}.enable_gradient_checkpointing": Ignored("FSDP's checkpointing; megarl's is "
                                                      f"{ACTOR}.recompute_granularity"),
    "critic.model.path": Rename("critic.model_path"),
    "critic.model.tokenizer_path": Ignored("the critic uses the policy's tokenizer (actor_rollout_ref.model)"),
    f"{ROLLOUT}.name": Rename(f"{ROLLOUT}.name", _engine),
    f"{ROLLOUT}.mode": Fixed(("async",), "megarl's engines are always servers driven asynchronously (verl's async "
                                         "mode)"),
    f"{ROLLOUT}.enable_chunked_prefill": _VLLM_SCHEDULER,
    f"{ROLLOUT}.max_num_batched_tokens": _VLLM_SCHEDULER,
    f"{ROLLOUT}.max_num_seqs": _VLLM_SCHEDULER,
    f"{ROLLOUT}.enable_prefix_caching": Ignored("SGLang's radix cache always reuses prefixes"),
    f"{ROLLOUT}.disable_log_stats": Ignored("engine logging"),
    f"{ROLLOUT}.load_format": Ignored("megarl's engines start from model.path and then receive the actor's weights"),
    f"{ROLLOUT}.multi_turn.max_assistant_turns": Rename(f"{ROLLOUT}.multi_turn.max_turns"),
    f"{ROLLOUT}.multi_turn.tokenization_sanity_check_mode":
        Rename(f"{ROLLOUT}.multi_turn.tokenization_sanity_check", _sanity_check_mode),
    "data.train_files": Rename("data.train_files", _as_list),
    # verl's main_generation (megarl-generate)
    "data.path": Rename("data.train_files", _as_list),
    "data.n_samples": Rename("generation.n_samples"),
    "data.output_path": Rename("generation.output_path"),
    "data.batch_size": Rename("generation.batch_size"),
    "data.val_files": Rename("data.val_files", _as_list),
    "data.reward_fn_key": Fixed(("data_source",), "megarl picks a row's scorer by its data_source column"),
    "data.dataloader_num_workers": Ignored("megarl reads the prompts in the driver"),
    "reward_model.strategy": Fixed(("megatron",), "megarl's reward model runs on Megatron-Core"),
    "reward_model.reward_manager": Fixed(("naive", "dapo"), "megarl's reward manager is verl's naive one; dapo's "
                                                            "overlong buffer is reward_model.overlong_buffer"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": Rename("reward_model.overlong_buffer.enable"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": Rename("reward_model.overlong_buffer.len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor":
        Rename("reward_model.overlong_buffer.penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": Rename("reward_model.overlong_buffer.log"),
    "reward_model.reward_kwargs.max_resp_len": Equal("data.max_response_length", "the overlong buffer ends at "
                                                     "data.max_response_length"),
    "custom_reward_function.path": Rename("reward_model.custom_reward_function.path"),
    "custom_reward_function.name": Rename("reward_model.custom_reward_function.name"),
    "trainer.total_training_steps": Rename("trainer.total_steps"),
    "trainer.default_hdfs_dir": Fixed((None,), "megarl writes checkpoints to trainer.default_local_dir only"),
}
"""verl's key (as its ``ppo_megatron_trainer.yaml`` names it) → what it is in megarl."""

VERL_PREFIXES: dict[str, Entry] = {
    f"{REF}.megatron.override_transformer_config.": _REF_TRANSFORMER,
    f"{MODEL}.override_config.": Ignored("megarl builds the model from its own config.json (a RoPE model's "
                                         "max_position_embeddings only caps its context, which megarl sets from "
                                         "rollout.max_model_len)"),
    f"{ROLLOUT}.engine_kwargs.": Ignored("vLLM/SGLang server arguments; megarl launches SGLang with its own"),
}
"""Families of verl keys, by prefix (an exact entry of :data:`VERL_KEYS` wins)."""

VERL_FOLLOWS: dict[str, tuple[str, ...]] = {
    f"{ACTOR}.use_dynamic_bsz": (f"{ROLLOUT}.log_prob_use_dynamic_bsz", f"{REF}.log_prob_use_dynamic_bsz",
                                 "critic.use_dynamic_bsz"),
    f"{ACTOR}.ppo_max_token_len_per_gpu": (f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
                                           f"{REF}.log_prob_max_token_len_per_gpu"),
    f"{ACTOR}.ppo_mini_batch_size": ("critic.ppo_mini_batch_size",),
    f"{ACTOR}.ppo_epochs": ("critic.ppo_epochs",),
    f"{ACTOR}.shuffle": ("critic.shuffle",),
    f"{ACTOR}.loss_agg_mode": ("critic.loss_agg_mode",),
    f"{ACTOR}.param_offload": (f"{REF}.param_offload",),
}
"""verl's defaults that follow another setting (``${oc.select:...}`` in its config): with verl's names in the
overrides, a follower not given takes its leader's value."""


def lookup(key: str) -> Entry | None:
    """The table's entry for verl's ``key``, if any."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    return next((entry for prefix, entry in VERL_PREFIXES.items() if key.startswith(prefix)), None)


@dataclasses.dataclass
class Translation:
    """Overrides in megarl's names, the verl settings ignored (key, why), and the :class:`Equal` checks
    (verl key, megarl key, value, why) to run on the composed config."""

    overrides: list[str] = dataclasses.field(default_factory=list)
    ignored: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    equal: list[tuple[str, str, Any, str]] = dataclasses.field(default_factory=list)
    verl: bool = False
    """Some override used a verl-only name."""


_OVERRIDE = re.compile(r"(?P<prefix>\+\+|\+|~)?(?P<key>[^=~+][^=]*?)(?:=(?P<raw>.*))?", re.DOTALL)


def _parse_value(text: str) -> Any:
    """An override's value as Hydra parses it (a string when Hydra cannot: Hydra will then say why)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(f"k={text}").value()
    except Exception:  # noqa: BLE001 - Hydra names the problem when it composes the original text
        return text


def translate(overrides: Sequence[str]) -> Translation:
    """Rewrite ``overrides`` into megarl's names (module docstring); raises :class:`VerlKeyError` for a value megarl
    refuses or a key it does not know."""
    out = Translation()
    given: dict[str, str] = {}
    for override in overrides:
        match = _OVERRIDE.fullmatch(override.strip())
        if match is None or match["key"].startswith("hydra") or match["key"] == "recipe":
            out.overrides.append(override)
            continue
        prefix, key, raw = match["prefix"] or "", match["key"].strip(), match["raw"]
        entry = lookup(key)
        if entry is None:
            if not is_declared(key):
                raise VerlKeyError(f"{key} is not a megarl setting (nor a verl one megarl knows)"
                                   f"{did_you_mean(key, declared_keys()[0] | VERL_KEYS.keys())}")
            if prefix in ("+", "++") and key in declared_keys()[0]:
                prefix = ""  # Hydra's "+key" hint for a key the schema declares
            out.overrides.append(f"{prefix}{key}" + ("" if raw is None else f"={raw}"))
            given[key] = raw
            continue
        out.verl = out.verl or not is_declared(key)
        _apply(entry, key, prefix, raw, out, given)
    if out.verl:
        _follow(out, given)
    if out.ignored:
        logger.warning("verl settings with no effect in megarl, accepted and ignored: %s", "; ".join(
            f"{', '.join(k for k, w in out.ignored if w == why)} ({why})" for why in dict.fromkeys(
                why for _, why in out.ignored)))
    return out


def _apply(entry: Entry, key: str, prefix: str, raw: str | None, out: Translation, given: dict[str, str]) -> None:
    if prefix == "~":
        raise VerlKeyError(f"~{key}: verl's settings cannot be deleted here; set the value you want instead")
    if raw is None:
        raise VerlKeyError(f"{key} needs a value ({key}=...)")
    value = _parse_value(raw)
    if isinstance(entry, Ignored):
        out.ignored.append((key, entry.why))
    elif isinstance(entry, Fixed):
        if value not in entry.values:
            allowed = " or ".join(str(v) if v is not None else "null" for v in entry.values)
            raise VerlKeyError(f"{key}={raw}: {entry.why} (accepted: {allowed})")
    elif isinstance(entry, Equal):
        out.equal.append((key, entry.key, value, entry.why))
    else:
        raw = entry.convert(raw, value) if entry.convert is not None else raw
        out.overrides.append(f"{entry.key}={raw}")
        given[entry.key] = raw


def _follow(out: Translation, given: dict[str, str]) -> None:
    """verl's followers (:data:`VERL_FOLLOWS`) and ``critic.enable`` from ``algorithm.adv_estimator``."""
    for leader, followers in VERL_FOLLOWS.items():
        if leader in given:
            out.overrides += [f"{f}={given[leader]}" for f in followers if f not in given]
    estimator = given.get("algorithm.adv_estimator")
    if estimator is not None and "critic.enable" not in given:
        try:
            out.overrides.append(f"critic.enable={uses_critic(_parse_value(estimator))}")
        except ValueError:
            pass  # an unknown estimator: algorithm.adv_estimator's own check names it


def check_equal(cfg: Any, checks: Sequence[tuple[str, str, Any, str]]) -> None:
    """Refuse an :class:`Equal` verl setting whose value differs from megarl's in the composed ``cfg``."""
    from omegaconf import OmegaConf

    for verl_key, key, value, why in checks:
        actual = OmegaConf.select(cfg, key)
        if actual != value:
            raise VerlKeyError(f"{verl_key}={value} differs from {key}={actual}: {why}; set {key} (or drop "
                               f"{verl_key})")
