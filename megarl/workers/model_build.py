"""How a role's Megatron model is built on its ranks (:class:`ModelBuild`), beside its directory, layout, optimizer and
process groups: what :class:`~megarl.workers.sharded_model.ShardedModel` takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class ModelBuild:
    """How a role's model is built on its ranks: everything but its directory, layout, optimizer and process groups
    (a worker makes one from its role's sections: ``megarl.workers.megatron_workers``).

    ``value_head`` builds a critic: the LM head is replaced by a scalar value head (megarl.models.value_head, seeded
    with ``seed``, untied from the embedding), the body loaded as for the actor; with ``score_head`` (a reward model)
    the head loads from the checkpoint's sequence-classification ``score``
    (:func:`megarl.convert.loader.load_hf_into`). ``params_dtype`` bf16/fp16 turns on Megatron's mixed precision (the
    family's ``transformer_config``); ``recompute_granularity`` (``full`` / ``selective`` / None) and
    ``recompute_num_layers`` are the role's activation recomputation. ``packed``: micro-batches reach the model packed
    (THD), else padded (:func:`megarl.parallel.forward_backward`). ``lora`` (a :class:`~megarl.config.lora.LoraSpec`):
    adapters on the targeted linear layers, everything else frozen. ``megatron_overrides``: the role's
    ``megatron.override_transformer_config`` (checked by the config), set last; ``transformer_overrides`` set other
    ``TransformerConfig`` fields directly (tests). ``use_te``: None builds TE's spec where TE and a GPU are (False:
    the local spec, a check's reference).
    """

    params_dtype: torch.dtype = torch.float32
    seed: int = 1234
    load_weights: bool = True
    value_head: bool = False
    score_head: bool = False
    recompute_granularity: str | None = None
    recompute_num_layers: int = 1
    trust_remote_code: bool = False
    packed: bool = True
    router_replay: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_load_balancing_type: str = "aux_loss"
    megatron_overrides: Mapping[str, Any] | None = None
    lora: Any = None
    use_te: bool | None = None
    transformer_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, build: ModelBuild | None = None, **fields: Any) -> ModelBuild:
        """``build`` (else the defaults) with ``fields`` set; a name that is not a field is a ``TransformerConfig``
        override."""
        names = {f.name for f in dataclasses.fields(cls)}
        overrides = {key: fields.pop(key) for key in list(fields) if key not in names}
        build = cls() if build is None else build
        if overrides:
            fields["transformer_overrides"] = {**build.transformer_overrides, **overrides}
        return dataclasses.replace(build, **fields)


def recompute_fields(recompute_granularity: str | None, recompute_num_layers: int) -> dict:
    """``TransformerConfig`` fields of a role's activation recomputation (``full`` recomputes uniform blocks)."""
    fields: dict = {}
    if recompute_granularity:
        fields["recompute_granularity"] = recompute_granularity
        if recompute_granularity == "full":
            fields.update(recompute_method="uniform", recompute_num_layers=recompute_num_layers)
    return fields
