"""The single controller: the step loop (``Trainer``, loaded on first use) and the placement of roles and engines on
Ray resource pools."""

from megarl.controller.placement import (
    EnginePlacement,
    PlacementPlan,
    PoolSpec,
    ResourcePool,
    RolePlacement,
    create_pools,
    make_placement,
    megatron_coordinates,
    plan_placement,
)

__all__ = [
    "Trainer",
    "EnginePlacement",
    "PlacementPlan",
    "PoolSpec",
    "ResourcePool",
    "RolePlacement",
    "create_pools",
    "make_placement",
    "megatron_coordinates",
    "plan_placement",
]


def __getattr__(name: str):
    if name == "Trainer":  # on first use: the trainer imports every layer below it
        from megarl.controller.trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
