"""The training roles' GPU memory between a step's phases (``<role>.param_offload`` / ``grad_offload`` /
``optimizer_offload``, ``ref.param_offload``; on CPU the workers' offload is a no-op).

Colocated with the engines, a role's state leaves the GPU before the engines start (so SGLang sizes its KV pool
beside what stays) and between the phases that use it. Around a weight sync the actor's update state (gradients,
optimizer states, the reference) leaves first: the sync holds the actor's weights, the engines' weights and the
buckets, not the whole training state beside them.
"""

from __future__ import annotations

from typing import Any

from megarl.config.schema import RunConfig
from megarl.workers.megatron_workers import ActorWorker
from megarl.workers.roles import SPEC_OF


def offload_flags(cfg: RunConfig, role: str) -> dict[str, bool]:
    """What ``role`` keeps on the host between its phases (the keyword arguments of the workers' ``offload``; its
    :class:`~megarl.workers.roles.RoleSpec`'s ``offload``)."""
    return SPEC_OF[role].offload(cfg)


def offload(cfg: RunConfig, group: Any, role: str, *, params: bool = True, state: bool = True) -> None:
    """Move ``role``'s memory to the host by its flags: ``params`` false keeps its weights, ``state`` false its
    gradients, optimizer states and reference (each moves once: the weights after a sync, the rest before it)."""
    flags = offload_flags(cfg, role)
    if not params:
        flags["params"] = False
    if not state:
        flags = {key: value and key == "params" for key, value in flags.items()}
    if any(flags.values()):
        group.call_all(ActorWorker.offload, **flags)


def onload(cfg: RunConfig, group: Any, role: str) -> None:
    """Bring back whatever :func:`offload` moved."""
    if any(offload_flags(cfg, role).values()):
        group.call_all(ActorWorker.onload)
