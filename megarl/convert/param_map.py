"""The parameter map: every Megatron parameter of a model, where it lives, what HF tensors it makes.

The plan is computed identically on every rank from the config and the layout alone (no
communication), which is what lets the exporters agree on bucket boundaries and buffer
sizes without exchanging metadata.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

import torch

from megarl.config.parallel import ParallelDims
from megarl.convert.layout import ModelSizes, hf_slices
from megarl.models.weights import WeightRule, coload_key

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(?P<e>\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.experts\.linear_fc(?P<fc>[12])\.weight(?P<e>\d+)$")
"""TransformerEngine's grouped GEMM (``TEGroupedMLP``, Megatron's MoE spec with ``moe_grouped_gemm``): its
``GroupedLinear`` registers one parameter per local expert, ``weight0`` .. ``weight{n-1}``
(``experts.linear_fc1.weight<local expert>``), where the local spec has ``experts.local_experts.<local expert>.``."""


@dataclasses.dataclass(frozen=True)
class Unit:
    """One Megatron parameter of the whole model, and the HF tensors it becomes."""

    rule: WeightRule
    layer: int | None
    pp_rank: int
    vp_stage: int
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    """Full HF shapes."""
    expert: int | None = None
    """The global expert of an expert tensor."""
    ep_owner: int | None = None
    """The expert-parallel rank holding that expert (experts split in contiguous blocks)."""

    @property
    def megatron_name(self) -> str:
        """Global Megatron name (local layer spec)."""
        return self.rule.megatron_name(self.layer, expert=self.expert)

    def shard_shapes(self, sizes: ModelSizes, tp_rank: int, tp: int) -> tuple[tuple[int, ...], ...]:
        """Shapes of the HF slices held by ``tp_rank``."""
        out = []
        for shape, where in zip(self.hf_shapes, hf_slices(self.rule, list(self.hf_shapes), sizes, tp_rank, tp)):
            if where.dim is None:
                out.append(shape)
            else:
                out.append(tuple(where.length if d == where.dim else n for d, n in enumerate(shape)))
        return tuple(out)


def layer_range(config, dims: ParallelDims, pp_rank: int, vp_stage: int) -> range:
    """Global layer indices held by pipeline rank ``pp_rank``'s virtual stage ``vp_stage``."""
    return dims.chunk_layers(config.num_layers, pp_rank, vp_stage)


def build_plan(family, hf_config, dims: ParallelDims, config, hf_shapes: dict[str, tuple[int, ...]]) -> list[Unit]:
    """Every parameter in HF order: embedding, layers in global order, final norm, output layer."""
    owners = {}  # global layer -> (pp_rank, vp_stage)
    for vp_stage in range(dims.num_virtual_stages):
        for pp_rank in range(dims.pp):
            for layer in layer_range(config, dims, pp_rank, vp_stage):
                owners[layer] = (pp_rank, vp_stage)
    first, last = (0, 0), (dims.pp - 1, dims.num_virtual_stages - 1)

    experts_per_rank = family.moe.num_experts(hf_config) // dims.ep if family.moe is not None else 0
    units = []
    for at in family.weight_instances(hf_config):
        if at.layer is not None:
            owner = owners[at.layer]
        else:
            owner = first if at.rule.on_first_stage else last
        names = at.hf_names
        units.append(Unit(at.rule, at.layer, *owner, names, tuple(hf_shapes[n] for n in names), expert=at.expert,
                          ep_owner=None if at.expert is None else at.expert // experts_per_rank))
    return units


def buckets(units: list[Unit], unit_bytes, bucket_bytes: int) -> list[list[Unit]]:
    """Consecutive units grouped up to ``bucket_bytes``; a bucket never spans two owners (pipeline stage and
    chunk, and for experts the expert-parallel rank: expert and other tensors never share a bucket), and never
    splits a co-load group (:attr:`~megarl.models.weights.WeightRule.coload`: the units from a group's first member
    to its last go into one bucket, which SGLang loads in one request).

    A unit (or such a span) larger than ``bucket_bytes`` travels alone.
    """
    out: list[list[Unit]] = []
    current: list[Unit] = []
    size = 0
    for span in coload_spans(units):
        nbytes = sum(unit_bytes(u) for u in span)
        owner_changes = current and ((current[-1].pp_rank, current[-1].vp_stage, current[-1].ep_owner)
                                     != (span[0].pp_rank, span[0].vp_stage, span[0].ep_owner))
        if current and (owner_changes or size + nbytes > bucket_bytes):
            out.append(current)
            current, size = [], 0
        current.extend(span)
        size += nbytes
    if current:
        out.append(current)
    return out


def coload_spans(units: list[Unit]) -> list[list[Unit]]:
    """``units`` in order, cut into the spans a bucket boundary may not fall inside: one unit each, except that the
    units from a co-load group's first member to its last (a layer's, all of one owner) form one span."""
    last = {coload_key(u): k for k, u in enumerate(units)}  # a group's last member (None: no group, unused)
    spans, k = [], 0
    while k < len(units):
        key = coload_key(units[k])
        end = k if key is None else last[key]
        spans.append(units[k:end + 1])
        k = end + 1
    return spans


def stripe_numel(numel: int, tp: int) -> int:
    """Elements of a bucket's buffer: ``numel`` rounded up to a multiple of ``tp`` (a bucket crosses pipeline
    stages in ``tp`` equal stripes)."""
    return -(-numel // tp) * tp


def ring_lengths(sizes: Sequence[int], count: int) -> list[int]:
    """The ``count`` buffers that buffers of ``sizes`` elements take turns in (the ``i``-th in buffer ``i mod
    count``), each as large as the largest it takes; ``count=0``: one allocation each."""
    if count == 0:
        return list(sizes)
    return [max(sizes[k::count], default=0) for k in range(count)]


@dataclasses.dataclass(frozen=True)
class RankBuckets:
    """The buckets of an export a rank holds and the buffers they take there (elements; :func:`rank_buckets`)."""

    held: tuple[int, ...]
    """Buckets the rank holds (yields), in turn in its ring of buffers."""
    passed: tuple[int, ...]
    """Expert buckets of its stage it does not hold but fills or receives for its expert-parallel group, each in a
    scratch buffer of the bucket's size."""
    ring: tuple[int, ...]
    """Each ring buffer: the largest held bucket it takes, a multiple of ``tp`` elements."""
    scratch: int
    """The largest ``passed`` bucket."""

    @property
    def numel(self) -> int:
        """Elements the rank's bucket buffers take at most (the ring and the largest scratch)."""
        return sum(self.ring) + self.scratch


def rank_buckets(numels: Sequence[int], owners: Sequence[int], experts: Sequence[bool], *, stage: int, tp: int,
                 tp_rank: int, num_buffers: int, to_pp_ranks: Iterable[int] | None, tp_ranks: Iterable[int] | None,
                 ep_tp_ranks: Iterable[int]) -> RankBuckets:
    """Which buckets a rank of pipeline stage ``stage`` and TP rank ``tp_rank`` holds, and the buffers they take, as
    :meth:`megarl.convert.export.WeightExporter.iter_buckets` allocates them (it calls this): buckets of
    ``numels`` elements owned by the stages ``owners`` (``experts``: an expert bucket), the other arguments as
    ``iter_buckets`` takes them; ``ep_tp_ranks``: the TP ranks of the rank's expert-parallel group (its own alone
    without expert parallelism).

    A rank holds its stage's buckets and, on a stage of ``to_pp_ranks`` (None: every stage), every other stage's;
    none when its TP rank is not in ``tp_ranks`` (None: all): it joins the all-gathers only, and passes its stage's
    expert buckets on to the members of its expert-parallel group that hold them."""
    receivers = None if to_pp_ranks is None else frozenset(to_pp_ranks)
    wanted = None if tp_ranks is None else set(tp_ranks)
    holds = wanted is None or tp_rank in wanted
    ep_needs = wanted is None or any(t in wanted for t in ep_tp_ranks)
    held = tuple(i for i, owner in enumerate(owners)
                 if holds and (receivers is None or owner == stage or stage in receivers))
    kept = set(held)
    passed = tuple(i for i, owner in enumerate(owners)
                   if i not in kept and owner == stage and experts[i] and ep_needs)
    ring = tuple(ring_lengths([stripe_numel(numels[i], tp) for i in held], num_buffers))
    return RankBuckets(held, passed, ring, max((numels[i] for i in passed), default=0))


def local_parameters(model_chunks, rules) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by global Megatron name (local-spec names; TE norm names mapped), LoRA adapters
    left out."""
    from megarl.models.build import layer_offset
    from megarl.models.lora import is_lora_parameter

    te_to_local = {rule.te_megatron: rule.megatron for rule in rules if rule.te_megatron}
    out = {}
    for chunk in model_chunks:
        module = chunk.module if hasattr(chunk, "module") else chunk  # unwrap Megatron DDP
        offset, expert_offset = layer_offset(module), _expert_offset(module)
        # A router's expert bias is a buffer (aux-loss-free balancing), a weight of the checkpoint all the same.
        tensors = [*module.named_parameters(),
                   *((n, b) for n, b in module.named_buffers() if n.endswith(".router.expert_bias"))]
        for name, param in tensors:
            if is_lora_parameter(name):  # adapters are not HF weights (exported merged or as PEFT's)
                continue
            match = _LAYER.match(name)
            if match is None:
                out[name] = param
                continue
            template = _LAYER.sub("decoder.layers.{i}.", name)
            # A local expert (global index = this rank's first expert + local index), in either spelling; the
            # grouped one becomes its rule's te_megatron template, which names the local spec's parameter.
            expert = _EXPERT.search(template) or _GROUPED_EXPERT.search(template)
            if expert is not None:
                template = _EXPERT.sub(".experts.local_experts.{e}.", template)
                template = _GROUPED_EXPERT.sub(r".experts.linear_fc\g<fc>.weight{e}", template)
            template = te_to_local.get(template, template)
            out[template.format(i=int(match.group(1)) + offset,
                                e=int(expert.group("e")) + expert_offset if expert is not None else None)] = param
    return out


def _expert_offset(module) -> int:
    """The global index of this rank's first expert (experts split in contiguous blocks over expert parallelism)."""
    experts = getattr(module.config, "num_moe_experts", None)
    if not experts:
        return 0
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (experts // ep)

