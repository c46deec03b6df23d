"""The parallel layout of one model: tensor, pipeline, context and data parallel degrees.

``ParallelDims`` is a plain value: it knows nothing about processes. It is the ``parallel``
section of each Megatron role in the run config (``actor_rollout_ref.actor.parallel``,
``critic.parallel``) and travels as it is to the workers, which build their process groups
from it (:func:`megarl.parallel.init_parallel`; ``megarl.parallel`` re-exports it). It checks
that its degrees factor the world size and, when they do not, says which setting to change.
Everything that needs the layout receives a ``ParallelDims``; nothing reads it from globals.
"""

from __future__ import annotations

import dataclasses
import enum


class MeshAxis(str, enum.Enum):
    """Names of the parallel axes, as used in settings and error messages."""

    TP = "tp"
    PP = "pp"
    CP = "cp"
    DP = "dp"


CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


@dataclasses.dataclass(kw_only=True)
class ParallelDims:
    """Degrees of parallelism for one model replica set (``<role>.parallel.*``).

    ``dp`` may be left ``None`` and derived from the world size with :meth:`for_world`.
    ``vpp`` is the number of virtual pipeline chunks per pipeline rank (interleaved 1F1B);
    ``None`` or 1 means no interleaving.
    """

    tp: int = 1
    """Tensor-parallel degree: each weight matrix is split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel degree: the layers are split into this many stages."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks (Megatron's 2·cp zigzag split; every
    sequence of a pack split the same way)."""
    cp_comm_type: str = "p2p"
    """How TransformerEngine's attention exchanges keys and values under ``cp > 1`` on GPU: ``p2p`` (a ring,
    overlapped with compute), ``all_gather`` or ``a2a`` (Ulysses: heads ↔ sequence; needs the heads per TP rank
    divisible by ``cp``). On CPU megarl's attention always all-gathers."""
    dp: int | None = None
    """Data-parallel degree; ``None`` until bound to a world size."""
    vpp: int | None = None
    """Virtual pipeline chunks per pipeline rank; needs ``pp > 1``."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside the TP group (needs ``tp > 1``)."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts models): the experts of each sparse layer are split over this
    many ranks, each holding a contiguous block of them. Expert parallelism folds into data parallelism: the
    ranks ``tp × cp × dp`` of a pipeline stage are regrouped as ``etp × ep × expert data parallel``."""
    etp: int | None = None
    """Expert-tensor-parallel degree: each expert's matrices split over this many ranks; None: ``tp``."""
    first_stage_layers: int | None = None
    """Layers of the first pipeline stage, where they do not split evenly (DeepSeek-V3's and Kimi-K2's 61 layers;
    Megatron's ``num_layers_in_first_pipeline_stage``, verl's key of that name in ``override_transformer_config``); the
    other stages share the rest evenly (:meth:`chunk_layers`). None: an even split."""
    last_stage_layers: int | None = None
    """Layers of the last pipeline stage (Megatron's ``num_layers_in_last_pipeline_stage``), as
    :attr:`first_stage_layers`; a lighter last stage leaves room for the LM head and its logits."""

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "cp", "ep"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{axis} must be a positive integer, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"parallel.etp must be a positive integer or null (= parallel.tp), got {self.etp!r}")
        if self.dp is not None and (not isinstance(self.dp, int) or self.dp < 1):
            raise ValueError(f"parallel.dp must be a positive integer, got {self.dp!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise ValueError(f"parallel.vpp must be a positive integer or null, got {self.vpp!r}")
            if self.vpp > 1 and self.pp == 1:
                raise ValueError(
                    f"parallel.vpp={self.vpp} needs pipeline parallelism: set parallel.pp > 1 "
                    "or parallel.vpp to null"
                )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"parallel.cp_comm_type={self.cp_comm_type!r}: choose one of {', '.join(CP_COMM_TYPES)} "
                             "(a2a+p2p needs hierarchical CP sizes, which megarl does not set)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=True needs parallel.tp > 1; set it to false")
        for key in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, key)
            if value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{key} must be a positive integer or null, got {value!r}")
            if self.pp == 1:
                raise ValueError(f"parallel.{key}={value} sizes a pipeline stage: it needs parallel.pp > 1 (or set it "
                                 f"to null)")

    @property
    def expert_tp(self) -> int:
        """Expert-tensor-parallel degree (``etp``, or ``tp`` when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert among a pipeline stage's ranks: ``tp × cp × dp / (etp × ep)``."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep) if self.dp is not None else 0

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: tp × pp × cp."""
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        """tp × pp × cp × dp; requires ``dp`` to be set."""
        if self.dp is None:
            raise ValueError("ParallelDims.dp is not set; bind it with ParallelDims.for_world(world_size)")
        return self.model_parallel_size * self.dp

    @property
    def num_virtual_stages(self) -> int:
        """Model chunks held by each pipeline rank (1 without interleaving)."""
        return self.vpp or 1

    @property
    def uneven(self) -> bool:
        """Whether the first or the last pipeline stage has its own number of layers."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage: :attr:`first_stage_layers` and :attr:`last_stage_layers` where set, the
        rest split evenly over the other stages (Megatron's ``get_transformer_layer_offset``); checked by
        :meth:`check_layers`."""
        first, last = self.first_stage_layers, self.last_stage_layers
        middle = self.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        counts = [rest // middle if middle else 0] * self.pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts

    def chunk_layers(self, num_layers: int, pp_rank: int, vp_stage: int = 0) -> range:
        """Global layer indices of pipeline rank ``pp_rank``'s model chunk ``vp_stage``: each stage's layers
        (:meth:`stage_layer_counts`) split evenly over its ``vpp`` chunks, chunk ``v`` of every stage before chunk
        ``v + 1`` of any (interleaving)."""
        counts = [n // self.num_virtual_stages for n in self.stage_layer_counts(num_layers)]
        start = vp_stage * sum(counts) + sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])

    def stage_layers(self, num_layers: int, pp_rank: int) -> list[int]:
        """Global layer indices held by pipeline rank ``pp_rank`` (every one of its chunks)."""
        return [layer for v in range(self.num_virtual_stages) for layer in self.chunk_layers(num_layers, pp_rank, v)]

    def check_layers(self, num_layers: int) -> None:
        """Check that ``num_layers`` layers split into the pipeline chunks: evenly, or with the first/last stage
        sizes given, the rest evenly over the other stages; each stage's layers evenly over its ``vpp`` chunks."""
        stages, chunks = self.pp * self.num_virtual_stages, self.num_virtual_stages
        if not self.uneven:
            if stages > num_layers:
                raise ValueError(
                    f"parallel.pp × parallel.vpp = {stages} pipeline chunks exceed the model's {num_layers} "
                    f"layers: use at most {num_layers} chunks"
                )
            if num_layers % stages != 0:
                raise ValueError(
                    f"the model's {num_layers} layers do not split evenly into parallel.pp × parallel.vpp = "
                    f"{stages} pipeline chunks: choose pp × vpp dividing {num_layers}, or give the first and/or last "
                    f"stage its own count (parallel.first_stage_layers / parallel.last_stage_layers)"
                )
            return
        given = {k: v for k, v in (("first_stage_layers", self.first_stage_layers),
                                   ("last_stage_layers", self.last_stage_layers)) if v is not None}
        keys = " + ".join(f"parallel.{k}" for k in given)
        middle = self.pp - len(given)
        rest = num_layers - sum(given.values())
        if rest < middle or (middle == 0 and rest != 0):
            raise ValueError(f"{keys} = {sum(given.values())} leave {rest} of the model's {num_layers} layers for "
                             f"the other {middle} pipeline stage(s): give every stage at least one layer and all "
                             f"{num_layers} in all")
        if middle and rest % (middle * chunks):
            raise ValueError(f"{keys} = {sum(given.values())} leave {rest} layers, which do not split evenly over the "
                             f"other {middle} pipeline stage(s) × parallel.vpp={chunks}: choose them so that "
                             f"{middle * chunks} divides the rest")
        for key, value in given.items():
            if value % chunks:
                raise ValueError(f"parallel.{key}={value} does not split evenly into parallel.vpp={chunks} chunks")

    def for_world(self, world_size: int) -> "ParallelDims":
        """Return these dims with ``dp`` derived from (or checked against) ``world_size``."""
        mp = self.model_parallel_size
        if world_size % mp != 0:
            raise ValueError(
                f"parallel.tp × parallel.pp × parallel.cp = {self.tp} × {self.pp} × {self.cp} = {mp} "
                f"does not divide the world size {world_size}: change parallel.tp/pp/cp so that their "
                f"product divides {world_size}, or run on a multiple of {mp} ranks"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"parallel.dp={self.dp} but tp × pp × cp = {mp} on {world_size} ranks leaves dp={dp}: "
                f"set parallel.dp={dp} (or leave it null to derive it)"
            )
        stage = self.tp * self.cp * dp
        if stage % (self.expert_tp * self.ep) != 0:
            raise ValueError(
                f"parallel.etp × parallel.ep = {self.expert_tp} × {self.ep} does not divide the {stage} ranks of a "
                f"pipeline stage (tp × cp × dp = {self.tp} × {self.cp} × {dp}): the experts' layout must regroup "
                f"them; choose parallel.ep (and parallel.etp, null = tp) with etp × ep dividing {stage}"
            )
        return dataclasses.replace(self, dp=dp)

    def check_model(self, *, num_layers: int, num_attention_heads: int, num_query_groups: int,
                    num_experts: int | None = None, expert_ffn: int | None = None) -> None:
        """Check that a model with these sizes (``num_experts``: a mixture-of-experts model's routed experts per
        sparse layer, ``expert_ffn`` one expert's FFN size) can be split with these dims."""
        if not num_experts and (self.ep > 1 or self.expert_tp != self.tp):
            raise ValueError(f"parallel.ep={self.ep} / parallel.etp={self.etp} split experts, and the model has none: "
                             f"set parallel.ep=1 and parallel.etp=null")
        if num_experts:
            if num_experts % self.ep != 0:
                raise ValueError(f"parallel.ep={self.ep} does not divide the model's {num_experts} experts: choose "
                                 f"parallel.ep among the divisors of {num_experts}")
            if expert_ffn is not None and expert_ffn % self.expert_tp != 0:
                raise ValueError(f"parallel.etp={self.expert_tp} does not divide the experts' FFN size {expert_ffn}: "
                                 f"choose parallel.etp among its divisors")
            if self.tp > 1 and not self.sequence_parallel:
                raise ValueError(f"parallel.tp={self.tp} on a mixture-of-experts model needs "
                                 f"parallel.sequence_parallel=true (Megatron's MoE layer refuses tensor parallelism "
                                 f"without it in training)")
        if num_attention_heads % self.tp != 0:
            raise ValueError(
                f"parallel.tp={self.tp} does not divide the model's {num_attention_heads} attention heads: "
                f"choose parallel.tp among the divisors of {num_attention_heads}"
            )
        if num_query_groups % self.tp != 0:
            raise ValueError(
                f"parallel.tp={self.tp} does not divide the model's {num_query_groups} key/value heads "
                "(num_key_value_heads); Megatron does not replicate key/value heads across "
                f"tensor-parallel ranks: choose parallel.tp among the divisors of {num_query_groups}"
            )
        self.check_layers(num_layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Coordinates:
    """A rank's place in its role's layout: the value workers report to the controller over Ray.

    :class:`megarl.parallel.ProcessGroups` is a ``Coordinates`` that also holds the process groups.
    """

    dims: ParallelDims
    """The role's layout, ``dp`` bound to its world size."""
    rank: int
    """Global rank within the role."""
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0
    """Place in the expert-parallel group: this rank holds experts ``[ep_rank·E/ep, (ep_rank+1)·E/ep)``."""
    etp_rank: int = 0
    """Place in the expert-tensor-parallel group."""

    @property
    def world_size(self) -> int:
        """Ranks of the role."""
        return self.dims.world_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the role."""
        return self.dims.dp

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (it holds the output layer and computes losses)."""
        return self.pp_rank == self.dims.pp - 1

    @property
    def is_collect_rank(self) -> bool:
        """The rank whose outputs stand for its data-parallel replica: TP rank 0, CP rank 0, last pipeline stage.

        The one definition: worker groups gather from it, roles return their results on it.
        """
        return self.tp_rank == 0 and self.cp_rank == 0 and self.is_last_stage

    def as_coordinates(self) -> "Coordinates":
        """A plain :class:`Coordinates` (drops what a subclass adds, e.g. process groups that cannot be pickled)."""
        return Coordinates(dims=self.dims, rank=self.rank, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                           cp_rank=self.cp_rank, dp_rank=self.dp_rank, ep_rank=self.ep_rank, etp_rank=self.etp_rank)

    @classmethod
    def data_parallel(cls, rank: int, world_size: int) -> "Coordinates":
        """Rank ``rank`` of ``world_size`` ranks that are all data-parallel replicas (no model parallelism)."""
        return cls(dims=ParallelDims(dp=world_size), rank=rank, dp_rank=rank)
