"""The weight sync per step: its buckets, the buffers it takes on each GPU, and its time estimate.

Weight sync per step (:class:`SyncPlan`; the transport is ``rollout.weight_transport`` resolved as the run
resolves it): every engine loads the whole model as HF tensors in ``rollout.dtype`` (a tied LM head once),
one request per bucket. The estimate adds, on the busiest GPU, bytes over the link that carries them at
``trainer.links.*`` (:class:`~megarl.config.trainer.LinksConfig`), and ``trainer.links.request_ms`` per
request:

- ``tensor``: each stage's TP all-gathers (in turn: every stage waits for the buckets of the stages before
  it), the pipeline delivery of the buckets to the stages hosting engine ranks in ``1/tp`` stripes per GPU
  (InfiniBand when a pipeline group spans nodes; one broadcast when every other stage receives, one send per
  receiving stage otherwise) and the stripes' all-gather there; on the engine side its requests and each
  engine GPU copying its ``1/tp`` shard out of the buckets (HBM, read and write). The engine loads a bucket
  while the actor builds the next: the slower side plus one bucket of the faster.
- ``distributed``: the TP all-gathers (stages at once), every engine GPU receiving every bucket over
  InfiniBand (engines on their own nodes), the requests and the shard copies, in turn (each sender waits
  for the engines' answers before its next bucket).

Mixture-of-experts models under expert parallelism: an expert bucket is filled on the EP rank holding its experts
(gathered over their ETP group) and broadcast over the EP group; the plan adds that broadcast to the actor side.

The sync's memory (:class:`SyncMemory`, the **weight-sync buffers** row of :mod:`megarl.plan.memory`), in the
engine dtype as the transport reports it (:meth:`megarl.sync.base.WeightTransport.plan_buffers`, from the values
it asks the exporter for and the exporter's own rule, :func:`megarl.convert.param_map.rank_buckets`): on the actor
ranks that hold buckets, the buffers they take turns in (``tensor``: two, each as large as the largest bucket it
takes, buckets of ``rollout.bucket_mb / 2``, on every rank; ``distributed``: one, buckets of ``rollout.bucket_mb``,
on the TP-0 ranks, the others joining the all-gathers only; a tensor larger than a bucket travels alone and sizes
its buffer; a stage whose pipeline group hosts no engine rank holds only its own buckets; a rank that holds no
bucket passes its stage's expert buckets on to its EP group in a scratch of the bucket's size), and on every rank
the exporter's gather scratch, the largest TP-gathered parameter of its stage (model dtype; vocabulary rows gather
in place). ``distributed`` engines receive each bucket into a buffer of its size.
"""

from __future__ import annotations

import dataclasses
import math

from megarl.config.parallel import ParallelDims
from megarl.config.rollout import resolve_transport
from megarl.config.schema import RunConfig
from megarl.config.trainer import LinksConfig
from megarl.convert.param_map import Unit
from megarl.models.fp8 import BLOCK, QUANTIZE_BYTES_PER_ELEMENT, fp8_bytes
from megarl.models.sizes import Architecture
from megarl.models.weights import Split
from megarl.plan.all_to_all import ep_link
from megarl.plan.memory import DTYPE_BYTES
from megarl.plan.placement import PlacementPlan, engine_replica, expert_groups, megatron_coordinates
from megarl.sync import RankLayout, transport_class


@dataclasses.dataclass(frozen=True)
class SyncStep:
    """One step of a weight sync and what it costs the busiest GPU: bytes over one link, or engine requests."""

    side: str
    """``actor`` (building and moving buckets) or ``engine`` (loading them)."""
    what: str
    link: str
    """``intra_node``, ``infiniband``, ``hbm`` (see :class:`LinksConfig`) or ``requests``."""
    nbytes: int = 0
    count: int = 0
    """Requests, for ``link="requests"``."""

    def seconds(self, links: LinksConfig) -> float:
        if self.link == "requests":
            return self.count * links.request_ms / 1e3
        return self.nbytes / (links.gbps(self.link) * 1e9)


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """One full weight sync (HF tensors in the engine dtype) by the run's transport, and its time estimate."""

    transport: str
    """``tensor`` or ``distributed`` (``rollout.weight_transport`` resolved), or ``adapters`` (a LoRA run's adapters
    alone: :func:`adapter_sync`)."""
    model_bytes: int
    """All HF tensors of the model at the engine dtype (``adapters``: the adapters'): what each engine loads."""
    bucket_bytes: int
    """Most bytes a bucket groups (a larger tensor travels alone)."""
    buckets: int
    """Buckets per sync: requests each engine answers."""
    steps: tuple[SyncStep, ...]
    links: LinksConfig
    overlapped: bool
    """The engine side runs while the actor side builds the next bucket (``tensor``'s double buffering)."""
    senders: tuple[int, ...]
    """Actor ranks (training-pool bundles) that post the engine requests."""

    def side_seconds(self, side: str) -> float:
        return sum(step.seconds(self.links) for step in self.steps if step.side == side)

    @property
    def seconds(self) -> float:
        """Estimated seconds per sync: the steps in turn; with ``overlapped``, the slower side plus one
        bucket's worth of the faster one (filling and draining the pipeline)."""
        actor, engine = self.side_seconds("actor"), self.side_seconds("engine")
        if not self.overlapped:
            return actor + engine
        return max(actor, engine) + min(actor, engine) / self.buckets


@dataclasses.dataclass(frozen=True)
class SyncMemory:
    """A weight sync's plan and the buffers it takes on the GPUs."""

    plan: SyncPlan
    actor: dict[int, int]
    """Each actor rank's sync buffers (bytes, by training-pool bundle)."""
    engine: int
    """The buffer an engine GPU receives a bucket into (``distributed``; 0 for ``tensor``, whose engines read the
    actor's buffers)."""


def plan_weight_sync(cfg: RunConfig, model: Architecture, placement: PlacementPlan) -> SyncMemory:
    """The weight sync of ``cfg``'s actor on ``placement`` (the module docstring)."""
    if cfg.lora_syncs_adapters:
        return adapter_sync(cfg, model, placement)
    return _WeightSync(cfg, model, placement).memory()


ADAPTER_REQUESTS = 3
"""Engine requests of a sync of adapters: unload, load, weight version."""


def adapter_sync(cfg: RunConfig, model: Architecture, placement: PlacementPlan) -> SyncMemory:
    """A LoRA run's sync of its adapters alone (``rollout.lora_sync=adapters``, :mod:`megarl.sync.adapters`): the
    whole adapter set in PEFT's layout at the engine dtype (``A`` once per HF module of a fused layer), gathered on
    every actor GPU (TP all-gathers, then the stages' over the pipeline group, through host memory) and posted by
    one sender per engine (colocated: the actor rank on its first GPU, a payload of handles to one copy; else its DP
    replica's first rank, the bytes by value over the network), three requests each; the engine copies the adapters
    into its LoRA slot. Buffers: the gathered adapters on every actor GPU, and a second copy (the payload's bucket)
    on a sender's."""
    arr = cfg.actor_rollout_ref
    dims = placement.role("actor").dims
    nbytes = model.lora_peft_param_count(arr.model.lora_spec) * DTYPE_BYTES[arr.rollout.dtype]
    bundles = placement.role("actor").bundles
    if placement.colocated:
        senders = tuple(sorted(e.bundles[0] for e in placement.engines))
    else:
        replicas = sorted({engine_replica(e, dims.dp) for e in placement.engines})
        senders = tuple(bundles[d * dims.tp * dims.cp] for d in replicas)
    steps = [SyncStep("actor", "the adapters gathered whole on every actor GPU", "intra_node", nbytes)]
    if not placement.colocated:
        steps.append(SyncStep("actor", "each sender posts them to its engines", "infiniband", nbytes))
    steps += [SyncStep("engine", f"{ADAPTER_REQUESTS} engine requests (unload, load, weight version)", "requests",
                       count=ADAPTER_REQUESTS),
              SyncStep("engine", "each engine GPU copies the adapters into its LoRA slot (read + write)", "hbm",
                       2 * nbytes)]
    plan = SyncPlan("adapters", nbytes, nbytes, 1, tuple(steps), cfg.trainer.links, overlapped=False,
                    senders=senders)
    return SyncMemory(plan, {b: nbytes * (2 if b in senders else 1) for b in bundles}, 0)


class _WeightSync:
    """One run's weight sync: its buckets, per-stage gathers, buffers and steps."""

    def __init__(self, cfg: RunConfig, model: Architecture, placement: PlacementPlan):
        arr = cfg.actor_rollout_ref
        self.cfg, self.model, self.placement = cfg, model, placement
        self.dims = dims = placement.role("actor").dims
        self.transport = resolve_transport(arr.rollout.weight_transport, colocated=placement.colocated,
                                           device=cfg.trainer.device)
        self.engine_bytes, self.dtype_bytes = DTYPE_BYTES[arr.rollout.dtype], DTYPE_BYTES[arr.model.dtype]
        self.pool = placement.pools[placement.role("actor").pool]
        self.stride = dims.tp * dims.cp * dims.dp  # rank r's pipeline peers: r mod stride + p * stride
        self.hosts = {b for e in placement.engines for b in e.bundles if e.pool == self.pool.name}
        self.units = _units(model, dims)
        self.cls = transport_class(self.transport)
        # The exporter's buckets at the engine dtype and the buffers the transport takes for them, as it reports.
        self.buffers = self.cls.plan_buffers(self.units, self._full, bucket_bytes=arr.rollout.bucket_mb << 20,
                                             element_size=self.engine_bytes, tp=dims.tp, ranks=self._ranks(),
                                             hosts=self.hosts)

    def _full(self, unit: Unit, size: int | None = None) -> int:
        """A unit's HF tensors in bytes (the engine dtype unless ``size``)."""
        return sum(math.prod(s) for s in unit.hf_shapes) * (size or self.engine_bytes)

    def _pipeline_ranks(self, rank: int) -> tuple[int, ...]:
        """``rank``'s pipeline group, stage by stage."""
        return tuple(rank % self.stride + p * self.stride for p in range(self.dims.pp))

    def _ranks(self) -> dict[int, RankLayout]:
        """Every actor rank's place, as the transport's buffers depend on it."""
        dims = self.dims
        ep_tp = {r: tuple(m % dims.tp for m in group) for group in expert_groups(dims) for r in group} \
            if dims.ep > 1 else {}
        out = {}
        for rank in range(self.pool.size):
            tp_rank, _, _, stage = megatron_coordinates(rank, dims)
            out[rank] = RankLayout(stage, tp_rank, self._pipeline_ranks(rank), ep_tp.get(rank, (tp_rank,)))
        return out

    def _receivers(self, rank: int) -> frozenset[int]:
        """The stages of ``rank``'s pipeline group that receive every bucket (as the transport says)."""
        return frozenset(self.cls.receiving_stages(self._pipeline_ranks(rank), self.hosts))

    def _per_stage(self) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        """Per pipeline stage: the gather scratch (bytes, model dtype), the bytes a rank receives in the TP (and
        ETP) all-gathers, and the expert bytes it receives over its EP group (engine dtype)."""
        m, dims = self.model, self.dims
        tp, etp, ep = dims.tp, dims.expert_tp, dims.ep
        vocab_in_place = (m.family.padded_vocab_size(m.hf_config, tp) == m.vocab
                          and self.engine_bytes == self.dtype_bytes)

        def split_size(u):  # the group a tensor's shards are gathered over: ETP for experts, else TP
            return etp if u.expert is not None else tp

        scratch, gathered, ep_received = {}, {}, {}
        for stage in range(dims.pp):
            own = [u for u in self.units if u.pp_rank == stage and u.rule.split is not Split.REPLICATED]
            # Split tensors gather through a scratch buffer in the model dtype, but vocabulary rows in place.
            scratch[stage] = max((self._full(u, self.dtype_bytes) for u in own if split_size(u) > 1
                                  and not (u.rule.split is Split.VOCAB and vocab_in_place)), default=0)
            dense = sum(self._full(u, self.dtype_bytes) for u in own if u.expert is None)
            experts = sum(self._full(u, self.dtype_bytes) for u in own if u.expert is not None)
            # A rank gathers the experts it holds (1/ep of them) over ETP; then each expert bucket is broadcast
            # over the EP group from its owner: a rank receives the other (ep - 1)/ep, in the engine dtype.
            gathered[stage] = dense * (tp - 1) // tp + experts * (etp - 1) // (etp * ep)
            ep_received[stage] = sum(self._full(u) for u in self.units
                                     if u.pp_rank == stage and u.expert is not None) * (ep - 1) // ep
        return scratch, gathered, ep_received

    def _actor_buffers(self, scratch: dict[int, int]) -> dict[int, int]:
        """Each actor rank's bucket buffers (the transport's) and gather scratch (the exporter's; bytes)."""
        return {rank: held + scratch[rank // self.stride] for rank, held in self.buffers.actor.items()}

    def _ep_steps(self, ep_received: dict[int, int]) -> list[SyncStep]:
        """The expert buckets' broadcast over each EP group (none without expert parallelism)."""
        if self.dims.ep == 1:
            return []
        in_turn = self.transport == "tensor"
        stages = (" (stages in turn)" if in_turn else " (stages at once)") if self.dims.pp > 1 else ""
        return [SyncStep("actor", "expert buckets broadcast over each EP group from the rank holding them" + stages,
                         ep_link(self.placement, self.dims),
                         sum(ep_received.values()) if in_turn else max(ep_received.values()))]

    def _pipeline_delivery(self) -> tuple[int, int, str]:
        """``tensor`` with pipeline stages: the most bytes a pipeline group delivers to its receiving stages, the most
        stripe bytes one of its GPUs sends for that, and the link between its stages."""
        tp, pp = self.dims.tp, self.dims.pp
        delivered = stripes = 0
        pp_link = "intra_node"
        for base in range(self.stride):
            wanted = self._receivers(base)
            members = [base + p * self.stride for p in range(pp)]
            if len({self.pool.node_of(r) for r in members}) > 1:
                pp_link = "infiniband"
            group_delivered = group_stripes = 0
            for i, stage in enumerate(self.buffers.owners):
                others = len(wanted - {stage})
                if others:
                    group_delivered += self.buffers.padded[i]
                    # one broadcast when every other stage receives, else one send per receiving stage
                    group_stripes += self.buffers.padded[i] // tp * (1 if others == pp - 1 else others)
            delivered, stripes = max(delivered, group_delivered), max(stripes, group_stripes)
        return delivered, stripes, pp_link

    def _actor_steps(self, gathered: dict[int, int], ep_steps: list[SyncStep], fraction: float = 1.0
                     ) -> list[SyncStep]:
        """Building the buckets and moving them to the engines' side (``fraction``: of their bytes, in FP8)."""
        tp, pp = self.dims.tp, self.dims.pp
        if self.transport != "tensor":
            return [SyncStep("actor", "TP all-gathers building the buckets" + (" (stages at once)" if pp > 1 else ""),
                             "intra_node", max(gathered.values())), *ep_steps,
                    SyncStep("actor", "broadcast: every engine GPU receives every bucket" +
                             (" (FP8)" if fraction < 1 else ""), "infiniband", int(sum(self.buffers.sizes) * fraction))]
        steps = [SyncStep("actor", "TP all-gathers building the buckets" + (" (stages in turn)" if pp > 1 else ""),
                          "intra_node", sum(gathered.values())), *ep_steps]
        if pp > 1:
            delivered, stripes, pp_link = self._pipeline_delivery()
            steps += [SyncStep("actor", f"buckets to the other stages' engine ranks, in 1/{tp} stripes per GPU",
                               pp_link, stripes),
                      SyncStep("actor", "TP all-gathers of the stripes on the receiving stages", "intra_node",
                               delivered * (tp - 1) // tp)]
        return steps

    def _senders(self) -> tuple[int, ...]:
        """The actor ranks that post the engine requests."""
        engines, dims = self.placement.engines, self.dims
        if self.transport == "tensor":
            return tuple(sorted(e.bundles[0] for e in engines))
        replicas = sorted({engine_replica(e, dims.dp) for e in engines})
        return tuple(sorted(p * self.stride + d * dims.tp * dims.cp for d in replicas for p in range(dims.pp)))

    def _fp8_fraction(self) -> float:
        """With FP8 engines (``rollout.quantization=fp8``): the bytes the engines receive over the exporter's (its
        linear weights in one byte plus an fp32 scale per 128 x 128 block); else 1."""
        if self.cfg.actor_rollout_ref.rollout.quantization != "fp8":
            return 1.0
        exported = sum(self._full(u) for u in self.units)
        sent = sum(sum(fp8_bytes(s) for s in u.hf_shapes) if u.rule.block_fp8 else self._full(u) for u in self.units)
        return sent / exported

    def _quantize_transient(self) -> int:
        """Bytes quantizing one weight takes besides its input and output: ``QUANTIZE_BYTES_PER_ELEMENT`` (12) per
        element of one row of blocks (128 rows) of the widest quantized weight."""
        rows = [min(shape[0], BLOCK[0]) * math.prod(shape[1:]) for u in self.units if u.rule.block_fp8
                for shape in u.hf_shapes]
        return QUANTIZE_BYTES_PER_ELEMENT * max(rows, default=0)

    def memory(self) -> SyncMemory:
        scratch, gathered, ep_received = self._per_stage()
        buffers = self.buffers
        fraction = self._fp8_fraction()
        # FP8: each bucket is quantized into one of two byte buffers of the sender's before it goes to the engines.
        model_bytes, count = int(sum(buffers.sizes) * fraction), buffers.buckets
        engine_tp = self.placement.engines[0].tp
        steps = [*self._actor_steps(gathered, self._ep_steps(ep_received), fraction),
                 SyncStep("engine", f"{count} engine requests, one per bucket", "requests", count=count),
                 SyncStep("engine", "each engine GPU copies its shard out of the buckets (read + write)", "hbm",
                          2 * model_bytes // engine_tp)]
        plan = SyncPlan(self.transport, model_bytes, buffers.bucket_bytes, count, tuple(steps),
                        self.cfg.trainer.links, overlapped=self.transport == "tensor", senders=self._senders())
        actor = self._actor_buffers(scratch)
        if fraction < 1.0:
            # The two byte buffers the quantized buckets take turns in, and the transients of quantizing one row of
            # blocks of the widest linear weight (quantize_block_fp8_into).
            quantizing = set(self.hosts) if self.transport == "tensor" else set(self._senders())
            held_there = 2 * max(buffers.sizes) + self._quantize_transient()
            actor = {rank: held + (held_there if rank in quantizing else 0) for rank, held in actor.items()}
        return SyncMemory(plan, actor, buffers.engine)

def _units(model: Architecture, dims: ParallelDims) -> list[Unit]:
    """Every tensor in HF order, placed as :func:`megarl.convert.param_map.build_plan` places it (experts by EP
    rank)."""
    owners = {layer: (pp_rank, v) for v in range(dims.num_virtual_stages) for pp_rank in range(dims.pp)
              for layer in dims.chunk_layers(model.num_layers, pp_rank, v)}

    def owner(layer):
        return owners[layer]

    experts_per_rank = model.num_experts // dims.ep if model.is_moe else 0
    last = (dims.pp - 1, dims.num_virtual_stages - 1)
    units = []
    for at in model.family.weight_instances(model.hf_config):
        place = owner(at.layer) if at.layer is not None else \
            (0, 0) if at.rule.on_first_stage else last
        units.append(Unit(at.rule, at.layer, *place, at.hf_names, tuple(model.hf_shape(t) for t in at.rule.hf),
                          expert=at.expert, ep_owner=None if at.expert is None else at.expert // experts_per_rank))
    return units
