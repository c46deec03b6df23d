"""Megatron settings passed through as verl passes them: ``<role>.megatron.override_transformer_config.*`` into
Megatron's ``TransformerConfig`` and ``<role>.optim.override_optimizer_config.*`` into its ``OptimizerConfig``.

Every key must be a field of the dataclass it lands in (megatron-core's own definition, read when a run names
one). Fields megarl sets from a setting of its own are refused, naming that setting (:func:`transformer_owned`,
:data:`OPTIMIZER_OWNED`), and so are the fields of the model's shape (from its ``config.json``). On
``trainer.device=cpu``, fusions whose kernels exist only on GPUs are refused (:data:`GPU_ONLY_TRANSFORMER`), and so
is Megatron's hybrid CPU optimizer (``optimizer_cpu_offload``: on a CPU run the states already are in host
memory).
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Mapping
from typing import Any

ARR = "actor_rollout_ref"
_LAYOUT = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
           "virtual_pipeline_model_parallel_size": "vpp", "context_parallel_size": "cp",
           "expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "etp",
           "sequence_parallel": "sequence_parallel", "cp_comm_type": "cp_comm_type",
           "num_layers_in_first_pipeline_stage": "first_stage_layers",
           "num_layers_in_last_pipeline_stage": "last_stage_layers"}
_DTYPE = ("params_dtype", "pipeline_dtype", "bf16", "fp16")
MODEL_SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "layernorm_epsilon", "normalization", "gated_linear_unit", "activation_func",
               "add_bias_linear", "add_qkv_bias", "qk_layernorm", "num_moe_experts", "moe_ffn_hidden_size",
               "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax", "moe_layer_freq",
               "moe_shared_expert_intermediate_size")
"""TransformerConfig fields megarl reads from the model's ``config.json`` (the family's mapping)."""


def transformer_owned(role: str) -> dict[str, str]:
    """The TransformerConfig fields megarl sets for ``role``, each with what to do instead."""
    owned = {name: f"set {role}.parallel.{ours} instead" for name, ours in _LAYOUT.items()}
    owned |= {name: f"set {ARR}.model.dtype instead" for name in _DTYPE}
    owned |= {name: f"the model's shape comes from its config.json ({ARR}.model.path)" for name in MODEL_SHAPE}
    owned["calculate_per_token_loss"] = "megarl's losses are normalised over the mini-batch's tokens (megarl.algo)"
    owned["perform_initialization"] = "megarl initialises the model and then loads the checkpoint's weights"
    actor = f"{ARR}.actor"
    owned |= {"recompute_granularity": f"set {actor}.recompute_granularity instead",
              "recompute_num_layers": f"set {actor}.recompute_num_layers instead",
              "moe_enable_routing_replay": f"set {actor}.router_replay.mode instead",
              "moe_aux_loss_coeff": f"set {actor}.moe_aux_loss_coeff instead",
              "moe_z_loss_coeff": f"set {actor}.moe_z_loss_coeff instead",
              "moe_router_load_balancing_type": f"set {actor}.moe_load_balancing_type instead"}
    if role != actor:  # the critic keeps its activations and trains without the MoE losses
        owned |= {name: f"megarl's {role} does not use it" for name in
                  ("recompute_granularity", "recompute_num_layers", "moe_enable_routing_replay", "moe_aux_loss_coeff",
                   "moe_z_loss_coeff", "moe_router_load_balancing_type")}
    return owned


OPTIMIZER_OWNED = {"lr": "optim.lr", "min_lr": "optim.min_lr", "weight_decay": "optim.weight_decay",
                   "adam_beta1": "optim.betas", "adam_beta2": "optim.betas", "adam_eps": "optim.eps",
                   "clip_grad": "optim.clip_grad", "use_distributed_optimizer": "optim.use_distributed_optimizer",
                   "optimizer": "", "params_dtype": "", "bf16": "", "fp16": ""}
"""OptimizerConfig fields megarl sets: from ``<role>.optim.<name>`` (the value), from the model's dtype, or Adam."""
GPU_ONLY_TRANSFORMER = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                        "gradient_accumulation_fusion", "persist_layer_norm", "moe_grouped_gemm", "moe_permute_fusion",
                        "moe_router_fusion", "moe_enable_deepep", "cross_entropy_loss_fusion")
"""TransformerConfig switches whose kernels exist only on GPUs (TransformerEngine, Apex, DeepEP, fused CUDA ops)."""


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    """Megatron settings of a role passed through (``<role>.megatron.*``, verl's names)."""

    override_transformer_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Fields of Megatron's ``TransformerConfig`` set as given over what megarl derives: kernel fusions, the MoE
    token dispatcher, ``moe_router_dtype``, pipeline output deallocation, ... (megatron-core's names). The reference
    model is built with the actor's."""


def _unknown(path: str, key: str, fields: list[str], what: str) -> str:
    near = difflib.get_close_matches(key, fields, n=3)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    return f"{path}.{key}: not a field of Megatron's {what} (megatron-core){hint}"


def typed_value(value: Any, hint: Any) -> Any:
    """``value`` as a field annotated ``hint`` holds it: an enum's member by name (``attention_backend=flash`` ->
    ``AttnBackend.flash``; Megatron compares members, and a string matches none, silently), a number for a number,
    a bool for a bool, one of a ``Literal``'s values; ``ValueError`` saying what the field takes otherwise. Types it
    cannot check (callables, dtypes) pass as given."""
    import enum
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return typed_value(value, option)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(" or ".join(errors))
    if origin is typing.Literal:
        if value in args:
            return value
        raise ValueError(f"one of {list(args)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError("a list")
        return [typed_value(v, args[0]) for v in value] if args else list(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if isinstance(value, hint):
            return value
        names = [m.name for m in hint]
        if isinstance(value, str) and value in names:
            return hint[value]
        raise ValueError(f"one of {names} ({hint.__name__})")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError("true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError("an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError("a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError("a string")
    return value


def typed_transformer_overrides(overrides: Mapping[str, Any], path: str = "override_transformer_config"
                                ) -> dict[str, Any]:
    """``overrides`` with each value as its ``TransformerConfig`` field holds it (:func:`typed_value`);
    ``ValueError`` naming ``<path>.<key>``, the value and what the field takes."""
    import typing

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import TransformerConfig

    hints = typing.get_type_hints(TransformerConfig)
    out = {}
    for key, value in overrides.items():
        try:
            out[key] = typed_value(value, hints[key]) if key in hints else value
        except ValueError as error:
            raise ValueError(f"{path}.{key}={value!r}: Megatron's TransformerConfig.{key} takes {error}") from None
    return out


def check_transformer_overrides(role: str, overrides: Mapping[str, Any], *, device: str) -> None:
    """Raise ``ValueError`` naming ``<role>.megatron.override_transformer_config.<key>`` for a key that is not a
    field of ``TransformerConfig``, one megarl sets itself, or a GPU-only fusion switched on with ``device=cpu``."""
    if not overrides:
        return
    with warnings.catch_warnings():  # Megatron announces its fallbacks without TransformerEngine on import
        warnings.simplefilter("ignore")
        from megatron.core.transformer import TransformerConfig

    path = f"{role}.megatron.override_transformer_config"
    fields = [f.name for f in dataclasses.fields(TransformerConfig)]
    owned = transformer_owned(role)
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(_unknown(path, key, fields, "TransformerConfig"))
        if key in owned:
            raise ValueError(f"{path}.{key}: megarl sets this field itself: {owned[key]}")
        if device == "cpu" and key in GPU_ONLY_TRANSFORMER and value:
            raise ValueError(f"{path}.{key}={value!r} needs GPU kernels (trainer.device=cpu): remove it or set it "
                             f"to false")
    typed_transformer_overrides(overrides, path)


def check_optimizer_overrides(role: str, overrides: Mapping[str, Any], *, device: str,
                              optimizer_offload: bool = False) -> None:
    """Raise ``ValueError`` naming ``<role>.optim.override_optimizer_config.<key>`` for a key that is not a field of
    ``OptimizerConfig``, one megarl sets itself, or the hybrid CPU optimizer with ``device=cpu`` or with megarl's own
    optimizer offload (``optimizer_offload``: ``<role>.optimizer_offload``)."""
    if not overrides:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer import OptimizerConfig

    path = f"{role}.optim.override_optimizer_config"
    fields = [f.name for f in dataclasses.fields(OptimizerConfig)]
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(_unknown(path, key, fields, "OptimizerConfig"))
        if key in OPTIMIZER_OWNED:
            ours = OPTIMIZER_OWNED[key]
            what = (f"set {role}.{ours} instead" if ours else
                    "megarl trains with Adam in the model's dtype (actor_rollout_ref.model.dtype)")
            raise ValueError(f"{path}.{key}: megarl sets this field itself: {what}")
    if device == "cpu" and overrides.get("optimizer_cpu_offload"):
        raise ValueError(f"{path}.optimizer_cpu_offload=True needs trainer.device=cuda (Megatron's hybrid optimizer "
                         f"moves GPU-held optimizer states to the host; on cpu they are there already): remove it")
    if overrides.get("optimizer_cpu_offload") and optimizer_offload:
        # Megatron's offload_to_cpu / restore_from_cpu move every optimizer state to the host and back to the GPU;
        # the hybrid optimizer's state holds its CPU sub-optimizer's states by reference, which then come back on the
        # GPU while its parameters stay on the host: its fused step fails at the second optimizer step.
        raise ValueError(f"{path}.optimizer_cpu_offload=True with {role}.optimizer_offload=true: Megatron's hybrid "
                         f"CPU optimizer keeps its host share on the host already, and offloading the rest moves that "
                         f"share to the GPU on the way back (its next step fails); set {role}.optimizer_offload=false "
                         f"(the GPU share then stays), or drop optimizer_cpu_offload")
    fraction = overrides.get("optimizer_offload_fraction")
    if fraction is not None and not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"{path}.optimizer_offload_fraction={fraction!r} must be in [0, 1]")


def offloaded_fraction(overrides: Mapping[str, Any]) -> float:
    """The share of a rank's optimizer states Megatron's hybrid optimizer keeps and steps on the host (0 without
    ``optimizer_cpu_offload``; ``optimizer_offload_fraction`` defaults to 0 in Megatron, as here)."""
    if not overrides.get("optimizer_cpu_offload"):
        return 0.0
    return float(overrides.get("optimizer_offload_fraction", 0.0))
