"""Megatron's dataclasses passed through: ``<role>.megatron.override_transformer_config.*`` and
``<role>.optim.override_optimizer_config.*`` land in the role's config as given; a key that is not a field of
Megatron's dataclass, one megarl sets itself, a GPU-only fusion or the hybrid CPU optimizer on CPU is refused,
naming the key and what to do."""

from __future__ import annotations

import dataclasses

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.megatron import MODEL_SHAPE, OPTIMIZER_OWNED, offloaded_fraction, transformer_owned

A = "actor_rollout_ref.actor"
TC = f"+{A}.megatron.override_transformer_config"
OC = f"+{A}.optim.override_optimizer_config"


def _load(*overrides: str):
    return load_config(["recipe=tiny_cpu_grpo", *overrides])


def test_the_overrides_land_in_the_role_sections():
    cfg = _load(f"{TC}.moe_router_dtype=fp32", f"{TC}.deallocate_pipeline_outputs=true",
                f"{OC}.loss_scale_window=500", f"{OC}.log_num_zeros_in_grad=true")
    actor = cfg.actor_rollout_ref.actor
    assert actor.megatron.override_transformer_config == {"moe_router_dtype": "fp32",
                                                         "deallocate_pipeline_outputs": True}
    assert actor.optim.override_optimizer_config == {"loss_scale_window": 500, "log_num_zeros_in_grad": True}
    assert cfg.critic.megatron.override_transformer_config == {}  # per role


@pytest.mark.parametrize(("override", "message"), [
    (f"{TC}.moe_router_dtyp=fp32", f"{A}.megatron.override_transformer_config.moe_router_dtyp: not a field of "
                                   f"Megatron's TransformerConfig (megatron-core); did you mean moe_router_dtype"),
    (f"{TC}.num_layers=3", "num_layers: megarl sets this field itself: the model's shape comes from its config.json"),
    (f"{TC}.tensor_model_parallel_size=2", f"set {A}.parallel.tp instead"),
    (f"{TC}.bf16=true", "set actor_rollout_ref.model.dtype instead"),
    (f"{TC}.moe_aux_loss_coeff=0.1", f"set {A}.moe_aux_loss_coeff instead"),
    (f"{TC}.apply_rope_fusion=true", "apply_rope_fusion=True needs GPU kernels (trainer.device=cpu)"),
    (f"{TC}.attention_dropout=abc", f"{A}.megatron.override_transformer_config.attention_dropout='abc': Megatron's "
                                    f"TransformerConfig.attention_dropout takes a number"),
    (f"{TC}.attention_backend=flashh", "attention_backend='flashh': Megatron's TransformerConfig.attention_backend "
                                       "takes one of ['flash', 'fused', 'unfused', 'local', 'auto'] (AttnBackend)"),
    (f"{TC}.deallocate_pipeline_outputs=maybe", "takes true or false"),
    (f"{TC}.moe_token_dispatcher_type=all2all", "takes one of ['allgather', 'alltoall', 'flex']"),
    (f"{OC}.adam_beta1=0.5", f"{A}.optim.override_optimizer_config.adam_beta1: megarl sets this field itself: "
                             f"set {A}.optim.betas instead"),
    (f"{OC}.lrr=0.5", f"{A}.optim.override_optimizer_config.lrr: not a field of Megatron's OptimizerConfig"),
    (f"{OC}.optimizer_cpu_offload=true", "optimizer_cpu_offload=True needs trainer.device=cuda"),
    (f"{OC}.optimizer_offload_fraction=1.5", "optimizer_offload_fraction=1.5 must be in [0, 1]"),
])
def test_a_refused_override_names_its_key_and_what_to_do(override, message):
    with pytest.raises(ConfigError) as raised:
        _load(override)
    assert message in str(raised.value)


def test_a_gpu_fusion_switched_off_is_accepted_on_cpu():
    assert _load(f"{TC}.apply_rope_fusion=false").actor_rollout_ref.actor.megatron.override_transformer_config == {
        "apply_rope_fusion": False}


def test_the_refusal_lists_name_real_fields_of_megatrons_dataclasses():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    transformer = {f.name for f in dataclasses.fields(TransformerConfig)}
    optimizer = {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert set(transformer_owned("critic")) <= transformer and set(MODEL_SHAPE) <= transformer
    assert set(OPTIMIZER_OWNED) <= optimizer


def test_the_offloaded_fraction_follows_megatrons_defaults():
    assert offloaded_fraction({}) == 0.0
    assert offloaded_fraction({"optimizer_offload_fraction": 0.5}) == 0.0  # without optimizer_cpu_offload
    assert offloaded_fraction({"optimizer_cpu_offload": True}) == 0.0  # Megatron's default fraction
    assert offloaded_fraction({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.7}) == 0.7


def test_an_enum_field_gets_its_member_by_name():
    """``attention_backend=flash`` was accepted and ignored: Megatron compares ``AttnBackend`` members, and the string
    matched none. The model gets the member; numbers and booleans keep their types."""
    from megatron.core.transformer.enums import AttnBackend

    from megarl.config.megatron import typed_transformer_overrides

    cfg = _load(f"{TC}.attention_backend=flash", f"{TC}.attention_dropout=0")
    overrides = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    typed = typed_transformer_overrides(overrides)
    assert typed == {"attention_backend": AttnBackend.flash, "attention_dropout": 0.0}
    assert isinstance(typed["attention_dropout"], float)
