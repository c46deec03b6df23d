"""The single controller: placement of roles and engines on Ray resource pools."""

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
