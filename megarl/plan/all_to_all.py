"""The expert-parallel all-to-all of a mixture-of-experts actor per step, and its time estimate.

All-to-all per step (:class:`AllToAllPlan`, mixture-of-experts models): Megatron's dispatcher sends each token's
``k`` routed copies (``h`` values at the model dtype) to the ranks holding their experts and brings them back:
``2 k h × bytes × (ep − 1)/ep`` per token and sparse layer leaves (and reaches) a GPU, the ``(ep − 1)/ep`` of
experts on other EP ranks for balanced routing. Per step: the rank's tokens (every row at full length, ``/tp``
with sequence parallelism, ``/cp``) × its stage's sparse layers × passes (the old and reference log-prob
forwards; per PPO epoch a forward and a backward, and a recomputed forward with full recompute).
"""

from __future__ import annotations

import dataclasses
import math

from megarl.config.parallel import ParallelDims
from megarl.config.schema import RunConfig
from megarl.config.trainer import LinksConfig
from megarl.models.sizes import Architecture
from megarl.plan.memory import DTYPE_BYTES
from megarl.plan.placement import PlacementPlan, expert_groups


def all_to_all_bytes_per_token(*, hidden: int, topk: int, ep: int, dtype_bytes: int) -> float:
    """Bytes one token sends to (and receives from) other expert-parallel ranks in one sparse layer's forward:
    dispatch and combine, ``topk`` copies of ``hidden`` values, the ``(ep - 1)/ep`` bound for other ranks."""
    return 2 * topk * hidden * dtype_bytes * (ep - 1) / ep


@dataclasses.dataclass(frozen=True)
class AllToAllPlan:
    """The expert-parallel all-to-all traffic of one actor GPU per step (mixture-of-experts models; the module
    docstring says what is counted)."""

    ep: int
    bytes_per_token: float
    """Bytes one token sends (and as many receives) in one sparse layer's forward: dispatch + combine."""
    tokens: int
    """Tokens the GPU routes per step (every row at full length)."""
    sparse_layers: int
    """Sparse layers on the GPU's pipeline stage (the stage with the most)."""
    passes: int
    """Passes through those layers per step: log-prob forwards, and per PPO epoch forward + backward (+ the
    recomputed forward under full recompute)."""
    link: str
    """``intra_node`` when every expert-parallel group stays on one node, else ``infiniband``."""
    links: LinksConfig

    @property
    def step_bytes(self) -> int:
        """Bytes one GPU sends per step (it receives as many)."""
        return math.ceil(self.bytes_per_token * self.tokens * self.sparse_layers * self.passes)

    @property
    def seconds(self) -> float:
        """``step_bytes`` over the link at ``trainer.links.*`` (no overlap with compute)."""
        return self.step_bytes / (self.links.gbps(self.link) * 1e9)


def ep_link(placement: PlacementPlan, dims: ParallelDims) -> str:
    """``intra_node`` when every expert-parallel group of the actor sits on one node, else ``infiniband``."""
    pool = placement.pools[placement.role("actor").pool]
    spans = any(len({pool.node_of(r) for r in group}) > 1 for group in expert_groups(dims))
    return "infiniband" if spans else "intra_node"


def plan_all_to_all(cfg: RunConfig, model: Architecture, placement: PlacementPlan) -> AllToAllPlan | None:
    """The actor's expert-parallel all-to-all per step (the module docstring); None for a dense model."""
    if not model.is_moe:
        return None
    arr = cfg.actor_rollout_ref
    dims, actor = placement.role("actor").dims, arr.actor
    rows = cfg.data.train_batch_size * arr.rollout.n // dims.dp
    split = dims.tp if actor.parallel.sequence_parallel else 1
    tokens = math.ceil(rows * sum(cfg.rollout_widths()) / split / dims.cp)
    sparse = max(sum(model.sparse[layer] for layer in model.stage_layers(dims, r))
                 for r in range(dims.pp))
    passes = 1 + int(cfg.needs_ref) + actor.ppo_epochs * (2 + int(actor.recompute_granularity == "full"))
    per_token = all_to_all_bytes_per_token(hidden=model.hidden, topk=model.topk, ep=dims.ep,
                                           dtype_bytes=DTYPE_BYTES[arr.model.dtype])
    return AllToAllPlan(dims.ep, per_token, tokens, sparse, passes, ep_link(placement, dims), cfg.trainer.links)
