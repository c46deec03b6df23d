"""What the CPU engine reads off a transformers model of a family megarl maps: its weights as the engine stores them,
whether SGLang's class for it reads weights back, its co-load groups, its routers and their experts under the
checkpoint's names, its vision spec."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megarl.models.vision import is_multimodal, model_config


class StoredWeights(Mapping):
    """An engine's weights by checkpoint name as it stores them: an FP8 engine's quantized weights and scales, the
    model's parameters for the rest."""

    def __init__(self, params: dict[str, torch.Tensor], fp8) -> None:
        self.params, self.fp8 = params, fp8

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.fp8 is not None and self.fp8.owns(name):
            return self.fp8.read(name)
        return self.params[name].detach()

    def __contains__(self, name) -> bool:
        return (self.fp8 is not None and self.fp8.owns(name)) or name in self.params

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def reads_back(model) -> bool:
    """Whether SGLang's model class for ``model`` answers ``/get_weights_by_name`` (its family's
    :attr:`~megarl.models.family.ModelFamily.engine_reads_back`; a family megarl does not map: no)."""
    from megarl.models import family_for

    try:
        return family_for(model.config).engine_reads_back
    except ValueError:
        return False


def coload_partners(model, fp8) -> dict[str, tuple[str, ...]]:
    """HF name -> its co-load group (:meth:`megarl.models.family.ModelFamily.coload_groups`) for a model of a family
    megarl maps, an FP8 engine's scales grouped as their weights; empty for others."""
    from megarl.models import family_for
    from megarl.models.fp8 import scale_name

    try:
        groups = family_for(model.config).coload_groups(model_config(model.config))
    except ValueError:
        return {}
    if fp8 is not None:
        groups += [tuple(scale_name(n) for n in group) for group in groups if all(n in fp8.weights for n in group)]
    return {name: group for group in groups for name in group}


def expert_biases(model) -> dict[str, torch.Tensor]:
    """A router's expert bias (aux-loss-free balancing) by name: a buffer in transformers, which weight updates write
    all the same (SGLang holds it as a parameter)."""
    return {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def vision_spec(hf_config):
    """The vision spec of a vision-language model of a family megarl maps, else None."""
    from megarl.models import family_for

    if not is_multimodal(hf_config):
        return None
    return family_for(hf_config).vision


def moe_spec(model):
    """The :class:`~megarl.models.moe.MoESpec` of a transformers model of a family megarl maps, else ``None``
    (a dense model, or a family megarl does not map: its own names only)."""
    from megarl.models import family_for

    try:
        return family_for(model.config).moe
    except ValueError:
        return None


def routers(model) -> list[tuple[int, torch.nn.Module]]:
    """The MoE routers of a transformers model of a known family (``model.layers.{i}.mlp.gate`` on its sparse
    layers, :class:`~megarl.models.moe.MoESpec`), by layer."""
    spec = moe_spec(model)
    if spec is None:
        return []
    modules = dict(model.named_modules())
    return [(layer, modules[f"model.layers.{layer}.mlp.gate"])
            for layer, sparse in enumerate(spec.sparse_layers(model.config)) if sparse]


def hub_views(model, params: dict) -> dict:
    """A mixture-of-experts model's router and experts under the checkpoint's (and SGLang's) names: transformers
    holds them fused in memory (see :meth:`megarl.models.moe.MoESpec.hub_views`)."""
    spec = moe_spec(model)
    return spec.hub_views(params, model.config) if spec is not None else {}
