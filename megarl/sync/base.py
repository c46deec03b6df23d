"""What every weight transport shares: the interface, the bucket payload, verification and statistics.

A transport is built once per actor worker (collectively: every actor rank constructs it with the same
engines) and then :meth:`WeightTransport.sync` runs once per weight sync, on every actor rank, around the
exporter's collective bucket stream (:meth:`megarl.convert.export.WeightExporter.iter_buckets`). The ranks
that drive an engine open its ``/begin_weight_update`` session, deliver every bucket, close the session,
flush the engine's cache, and read back the verified tensors with ``/get_weights_by_name``; they return
the statistics, the other ranks ``None``.
"""

from __future__ import annotations

import abc
import dataclasses
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from megarl.convert.param_map import Unit, buckets, rank_buckets, stripe_numel
from megarl.engines import event_loop
from megarl.engines.client import EngineAddress, EngineClient, EngineError, gather_sync
from megarl.parallel.cpu_support import plain_torch

TRANSPORTS = ("tensor", "distributed")

VERIFY_MAX_VALUES = 1 << 20
"""Values of one tensor that verification reads back: a tensor up to this size is compared whole, a larger one by
its leading rows up to it (at least one row). ``/get_weights_by_name`` answers JSON lists: whole, a 7B model's
545 M-value ``lm_head`` would take minutes per engine and sync (on an H200 a 0.5B model's 344 tensors read back
whole took over 200 s)."""
"""The transports of whole weights (a LoRA run may sync its adapters alone instead: :mod:`megarl.sync.adapters`)."""


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Where an actor rank sits, as far as its sync buffers depend on it (its Megatron coordinates)."""

    stage: int
    tp_rank: int
    pipeline_ranks: tuple[int, ...]
    """Its pipeline group's ranks, stage by stage."""
    ep_tp_ranks: tuple[int, ...]
    """The TP ranks of its expert-parallel group's members (its own TP rank alone without expert parallelism)."""


@dataclasses.dataclass(frozen=True)
class SyncBuffers:
    """The buckets of one weight sync by a transport and the buffers it takes for them
    (:meth:`WeightTransport.plan_buffers`; bytes)."""

    transport: str
    bucket_bytes: int
    """Most bytes a bucket groups (a larger tensor travels alone)."""
    num_buffers: int
    """Buffers a holding actor rank's buckets take turns in (bucket ``i`` in buffer ``i mod num_buffers``)."""
    sizes: tuple[int, ...]
    """Each bucket's bytes, in HF order: one engine request each."""
    owners: tuple[int, ...]
    """Each bucket's pipeline stage."""
    padded: tuple[int, ...]
    """Each bucket's buffer: a multiple of ``tp`` elements (a bucket crosses stages in ``tp`` stripes)."""
    actor: dict[int, int]
    """Each actor rank's bucket buffers (by rank): its ring, and a scratch for expert buckets it passes on."""
    engine: int
    """The buffer an engine GPU receives a bucket into (0: the engines read the actor's buffers)."""

    @property
    def buckets(self) -> int:
        return len(self.sizes)


class WeightTransport(abc.ABC):
    """One way of moving the actor's buckets into the engines (see the module docstring).

    What it asks of the exporter (:meth:`export_args`) is set by class attributes, so that the planner
    (:mod:`megarl.plan.weight_sync`) counts what a sync allocates from the same values (:meth:`plan_buffers`)."""

    name = ""
    num_buffers = 1
    """Buffers a holding actor rank's buckets take turns in; ``rollout.bucket_mb`` is split over them."""
    holding_tp_ranks: tuple[int, ...] | None = None
    """The TP ranks of a stage that hold the buckets (None: all); the others join the all-gathers only."""
    shared_memory = False
    """CPU bucket buffers in shared memory (the engines open them by handle)."""
    engines_receive = False
    """Each engine GPU receives every bucket into a buffer of its own (else it reads the actor's buffers)."""
    receivers: tuple[int, ...] = ()
    """The stages of this rank's pipeline group that need every bucket besides their own
    (:meth:`receiving_stages`)."""

    quantization: str | None = None
    """``fp8``: the engines serve block FP8 (``rollout.quantization``): every bucket goes out quantized
    (:meth:`buckets`)."""

    def __init__(self, groups, engines: Sequence[EngineAddress]) -> None:
        self.groups = groups
        self.engines = list(engines)
        self._fp8_buffers: list = [None, None]
        self._clients: dict[str, EngineClient] = {}
        self._loop: event_loop.EventLoopThread | None = event_loop.hold()
        """The process's event loop, held until :meth:`close`: the clients' sessions live on it."""
        self.group = None
        """The gloo group of the host ranks of the engine on this rank's GPU (:func:`host_group`), if it has one."""

    @classmethod
    def bucket_budget(cls, bucket_bytes: int) -> int:
        """Most bytes a bucket groups when ``bucket_bytes`` (``rollout.bucket_mb``) bounds what the ring holds."""
        return max(1, bucket_bytes // cls.num_buffers)

    @classmethod
    def receiving_stages(cls, pipeline_ranks: Sequence[int], hosts: Collection[int]) -> tuple[int, ...]:
        """The stages of a pipeline group (``pipeline_ranks``: its ranks, stage by stage) that need every bucket
        besides their own, given the actor ranks on the engines' GPUs (``hosts``): none by default."""
        return ()

    def export_args(self, bucket_bytes: int) -> dict[str, Any]:
        """This rank's :meth:`~megarl.convert.export.WeightExporter.iter_buckets` arguments for a sync of
        ``bucket_bytes`` (``rollout.bucket_mb``)."""
        return {"bucket_bytes": self.bucket_budget(bucket_bytes), "num_buffers": self.num_buffers,
                "to_pp_ranks": self.receivers, "tp_ranks": self.holding_tp_ranks, "shared_memory": self.shared_memory}

    @classmethod
    def plan_buffers(cls, units: Sequence[Unit], unit_bytes: Callable[[Unit], int], *, bucket_bytes: int,
                     element_size: int, tp: int, ranks: Mapping[int, RankLayout],
                     hosts: Collection[int] = ()) -> SyncBuffers:
        """The buckets and buffers of one sync of ``units`` (the exporter's, in HF order; ``unit_bytes``: a unit's
        bytes at ``element_size`` bytes per element) with ``bucket_bytes`` (``rollout.bucket_mb``), on the actor
        ranks ``ranks`` of TP ``tp``; ``hosts``: the actor ranks on engines' GPUs. As :meth:`export_args` asks
        and :func:`~megarl.convert.param_map.rank_buckets` (the exporter's own rule) allocates."""
        budget = cls.bucket_budget(bucket_bytes)
        groups = buckets(list(units), unit_bytes, budget)
        sizes = tuple(sum(unit_bytes(u) for u in bucket) for bucket in groups)
        numels = [size // element_size for size in sizes]
        owners = tuple(bucket[0].pp_rank for bucket in groups)
        experts = [bucket[0].ep_owner is not None for bucket in groups]
        actor = {}
        for rank, at in ranks.items():
            mine = rank_buckets(numels, owners, experts, stage=at.stage, tp=tp, tp_rank=at.tp_rank,
                                num_buffers=cls.num_buffers, to_pp_ranks=cls.receiving_stages(at.pipeline_ranks, hosts),
                                tp_ranks=cls.holding_tp_ranks, ep_tp_ranks=at.ep_tp_ranks)
            actor[rank] = mine.numel * element_size
        padded = tuple(stripe_numel(n, tp) * element_size for n in numels)
        engine = max(sizes, default=0) if cls.engines_receive else 0
        return SyncBuffers(cls.name, budget, cls.num_buffers, sizes, owners, padded, actor, engine)

    def sync(self, exporter, *, bucket_bytes: int, version: str | None,
             verify_names: Sequence[str] = (), flush_cache: bool = True) -> dict[str, float] | None:
        """One weight sync (collective over the actor's ranks); the sending ranks' statistics, else None.
        ``flush_cache``: flush the engines' caches after it (SGLang refuses while requests are held in place).

        Runs outside the CPU device-redirect mode (:func:`megarl.parallel.cpu_support.plain_torch`): a sync names
        no CUDA device, and the mode's per-call dispatch cost a driver rank 7 % of the CPU benchmark's sync."""
        with plain_torch():
            return self._sync(exporter, bucket_bytes=bucket_bytes, version=version, verify_names=verify_names,
                              flush_cache=flush_cache)

    def buckets(self, exporter, bucket_bytes: int):
        """The exporter's buckets for a sync of ``bucket_bytes``; with ``quantization=fp8`` each quantized into a
        byte buffer of its own (:func:`megarl.convert.fp8.quantize_bucket`: FP8 weights and their scales, the rest
        as it is), two taking turns: a buffer is refilled two buckets later, once the engine loaded from it (both
        transports wait for the engines' answer on a bucket before they send the next)."""
        buckets = exporter.iter_buckets(**self.export_args(bucket_bytes))
        if self.quantization != "fp8":
            yield from buckets
            return
        from megarl.convert.fp8 import fp8_names, quantize_bucket

        quantized = fp8_names(exporter.family, exporter.hf_config)
        for index, bucket in enumerate(buckets):
            turn = index % len(self._fp8_buffers)
            bucket = quantize_bucket(bucket, quantized, shared_memory=self.shared_memory,
                                     buffer=self._fp8_buffers[turn])
            self._fp8_buffers[turn] = torch.empty(0, dtype=torch.uint8, device=bucket.flat.device).set_(
                bucket.flat.untyped_storage())
            yield bucket

    def verified(self, verify_names: Sequence[str]) -> set[str]:
        """The names read back after a sync: ``verify_names``, and with ``quantization=fp8`` their scales too."""
        wanted = set(verify_names)
        if self.quantization == "fp8":
            from megarl.models.fp8 import scale_name

            wanted |= {scale_name(name) for name in wanted}  # names that are not quantized have no scale: unused
        return wanted

    @abc.abstractmethod
    def _sync(self, exporter, *, bucket_bytes: int, version: str | None,
              verify_names: Sequence[str], flush_cache: bool = True) -> dict[str, float] | None:
        """:meth:`sync` (the transport's own part)."""

    def close(self) -> None:
        """Give back what the transport holds (process groups, connections, its hold on the event loop)."""
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None
        for client in self._clients.values():
            client.close_sync()
        self._clients.clear()
        if self._loop is not None:
            self._loop = None
            event_loop.release()

    def client(self, engine: EngineAddress) -> EngineClient:
        """One client per engine for the transport's life: its keep-alive connections serve every sync."""
        if engine.url not in self._clients:
            self._clients[engine.url] = EngineClient(engine.url, name=engine.name, admin_key=engine.admin_key,
                                                     control_timeout_s=engine.timeout_s)
        return self._clients[engine.url]


def host_group(engines: Sequence[EngineAddress], rank: int) -> tuple[EngineAddress | None, Any]:
    """The colocated engine with a rank on actor rank ``rank``'s GPU (``rank`` is one of its host ranks) and the gloo
    group of its host ranks (None: it has one), or ``(None, None)``. Collective: every actor rank creates a group
    for every engine with more than one host rank, in the same order."""
    hosted, hosted_group = None, None
    for engine in engines:
        group = (torch.distributed.new_group(list(engine.host_ranks), backend="gloo")
                 if len(engine.host_ranks) > 1 else None)
        if rank in engine.host_ranks:
            if hosted is not None:
                raise ValueError(f"actor rank {rank} is a host rank of both {hosted.name} and {engine.name}")
            hosted, hosted_group = engine, group
    return hosted, hosted_group


def all_gather_handles(payload: bytes, group, host_ranks: Sequence[int]) -> list[bytes]:
    """Every host rank's payload (a handle to its own buffer), in engine TP order: engine TP rank ``r`` opens the one
    made on its own GPU. A symmetric collective: no rank leaves it before all joined. The group numbers its members
    by ascending global rank."""
    out: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, payload, group=group)
    by_rank = dict(zip(sorted(host_ranks), out, strict=True))
    return [by_rank[r] for r in host_ranks]


def flattened_payload(bucket, *, by_value: bool = False) -> bytes:
    """A handle to ``bucket``'s flat buffer as one ``/update_weights_from_tensor`` payload
    (``load_format="flattened_bucket"``): SGLang's ``FlattenedTensorBucket`` over the buffer itself (no
    copy: the metadata points into it), serialised with SGLang's ``MultiprocessingSerializer``: a CUDA IPC
    handle on GPU (with SGLang's torch-reduction patch, which names the device by UUID), a shared-memory
    file on CPU (torch's ``file_system`` strategy: the default one passes file descriptors over a connection
    only the sender's own children can open). Each payload is one reference the receiver gives back when it
    opens it: open each once. ``by_value``: the bytes themselves instead (plain pickle of a CPU bucket, which
    SGLang's safe unpickler reads), for an engine on another machine."""
    import pickle

    import torch.multiprocessing
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    flat = bucket.flat
    if by_value:
        if flat.device.type != "cpu":
            raise ValueError("a payload by value is made of a host bucket: copy it to the CPU first")
    elif flat.is_cuda:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    else:
        torch.multiprocessing.set_sharing_strategy("file_system")
    metadata = []
    for name, tensor in zip(bucket.names, bucket.tensors, strict=True):  # views of ``flat`` (of one or more dtypes)
        offset = tensor.data_ptr() - flat.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(FlattenedTensorMetadata(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                                end_idx=offset + nbytes, numel=nbytes))
    packed = FlattenedTensorBucket(flattened_tensor=flat.view(torch.uint8), metadata=metadata)
    content = {"flattened_tensor": packed.get_flattened_tensor(), "metadata": packed.get_metadata()}
    return pickle.dumps(content) if by_value else MultiprocessingSerializer.serialize(content)


async def verify_engine(client: EngineClient, expected: dict[str, torch.Tensor]) -> list[str] | None:
    """Compare ``client``'s engine's copy of every weight of ``expected`` (host tensors: the leading rows that
    :func:`expected_copy` keeps, the first ``len(tensor)`` rows are asked for) with it; the names
    it could not verify, or ``None`` when the engine cannot report weights at all (SGLang 0.5.23 has no
    ``get_weights_by_name`` for Qwen2/Qwen3: HTTP 400). ``RuntimeError`` naming the engine and the tensors that
    differ.

    An engine with TP > 1 answers whole only replicated tensors and the row-parallel ones it all-gathers (SGLang's
    ``LlamaForCausalLM.get_weights_by_name`` gathers ``o_proj``/``down_proj``); for column-parallel and vocabulary
    tensors it answers its TP rank 0's slice. An answer of another shape than the tensor is such a slice: the
    tensor is not verified (and reported so), never compared in part.

    A block-FP8 weight whose scale is in ``expected`` too (``rollout.quantization=fp8``) is compared by the values
    the pair stands for, within one e4m3 rounding at twice the scale (:func:`megarl.models.fp8.error_bound`, after a
    bf16 round trip): SGLang on
    Blackwell requantizes weights and scales to power-of-two (UE8M0) scales after every load, so neither the FP8
    bits nor the scale it answers are the ones sent; a scale is never compared by itself. A pair whose scale the
    engine cannot answer (SGLang narrows a fused name's scale by head counts: HTTP 400) is not verified."""
    from megarl.models.fp8 import scale_name

    pairs = {name: scale_name(name) for name in expected if scale_name(name) in expected}
    scales = set(pairs.values())
    differ, unverified = [], []
    for name, tensor in expected.items():
        if name in pairs or name in scales:
            continue
        try:
            values = await client.get_weights_by_name(name, truncate_size=tensor.shape[0] if tensor.dim() else 1)
        except EngineError as error:
            if error.status == 400:
                return None
            raise
        answer = torch.tensor(values, dtype=torch.float32)
        if answer.numel() != tensor.numel():
            unverified.append(name)
        elif not torch.equal(answer.reshape(tensor.shape), tensor.float()):
            differ.append(name)
    for name, scale in pairs.items():
        verdict = await _verify_fp8(client, name, expected[name], scale, expected[scale])
        if verdict is None:
            unverified += [name, scale]
        elif not verdict:
            differ.append(name)
    if differ:
        raise RuntimeError(f"weight sync: {client.name} at {client.url} does not hold the trainer's weights after "
                           f"the update ({len(differ)} tensors differ: {differ[:5]})")
    return unverified


async def _verify_fp8(client: EngineClient, name: str, weight: torch.Tensor, scale: str,
                      scales: torch.Tensor) -> bool | None:
    """Whether the engine's FP8 weight ``name`` and its scale stand for the values the sent pair stands for (its
    leading rows: ``weight`` and ``scales`` as :func:`expected_copy` kept them); None: not answered whole."""
    from megarl.models.fp8 import BLOCK, FP8_DTYPE, dequantize_block_fp8, error_bound

    rows = weight.shape[0]
    block_rows = -(-rows // BLOCK[0])
    try:
        got_weight = torch.tensor(await client.get_weights_by_name(name, truncate_size=rows), dtype=torch.float32)
        got_scale = torch.tensor(await client.get_weights_by_name(scale, truncate_size=block_rows),
                                 dtype=torch.float32)
    except EngineError as error:
        if error.status == 400:
            return None
        raise
    if got_weight.numel() != weight.numel() or got_scale.numel() != block_rows * scales.shape[1]:
        return None
    sent = dequantize_block_fp8(weight, scales[:block_rows])
    held = dequantize_block_fp8(got_weight.reshape(weight.shape).to(FP8_DTYPE), got_scale.reshape(block_rows, -1))
    # One e4m3 rounding at up to twice the scale, after SGLang's bf16 round trip (2^-9 relative: the 1 + 2^-4).
    bound = error_bound(sent, 2 * scales[:block_rows].float()) * (1 + 2 ** -4)
    return bool(((held - sent).abs() <= bound).all())


def expected_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A sent tensor as :func:`verify_engine` compares it: a host copy (the engines answer host values, and the
    bucket buffer it came from is refilled next) of its leading rows, at most :data:`VERIFY_MAX_VALUES` values
    (at least one row; all of a tensor that small)."""
    if tensor.dim() and tensor.numel() > VERIFY_MAX_VALUES:
        tensor = tensor[:max(1, VERIFY_MAX_VALUES // (tensor.numel() // tensor.shape[0]))]
    return tensor.detach().to("cpu", copy=True)


def verify_sample(names: Sequence[str], count: int, step: int) -> list[str]:
    """``count`` weight names to verify at ``step`` (all when ``count < 0``): a seeded sample plus the last."""
    names = list(names)
    if count < 0 or count >= len(names):
        return names
    if count == 0:
        return []
    picked = random.Random(step).sample(names[:-1], count - 1) if count > 1 else []
    return sorted(set(picked) | {names[-1]}, key=names.index)


def close_sessions(transport: WeightTransport, targets: Sequence[EngineAddress], *, flush_cache: bool = True) -> None:
    """End the targets' weight-update sessions and (``flush_cache``) flush their caches."""
    clients = [transport.client(t) for t in targets]
    gather_sync([c.end_weight_update() for c in clients])
    if flush_cache:
        gather_sync([c.flush_cache() for c in clients])


def verify_and_report(transport: WeightTransport, targets: Sequence[EngineAddress], *, start: float,
                      bytes_sent: int, buckets: int, expected: dict[str, torch.Tensor],
                      lead: bool) -> dict[str, Any]:
    """Verify ``expected`` (what this rank sent) on every target; this rank's statistics. ``lead``: the rank that
    opened and closed the targets' sessions (it counts the engines). ``verified_checks`` / ``unverified_checks``:
    tensors compared / answered only in part (TP slices), over all targets. ``unverifiable``: indices of the
    targets that cannot report weights, or reported none of ``expected`` whole (the trainer counts an engine
    verified when no sender found it unverifiable)."""
    clients = [transport.client(t) for t in targets]
    seconds = time.perf_counter() - start
    reports = gather_sync([verify_engine(c, expected) for c in clients]) if expected else [[] for _ in clients]
    delivered = bytes_sent * len(targets)
    compared = [0 if r is None else len(expected) - len(r) for r in reports]
    return {"weight_sync/seconds": seconds, "weight_sync/bytes": float(delivered),
            "weight_sync/buckets": float(buckets), "verified_checks": sum(compared),
            "unverified_checks": sum(len(r) for r in reports if r is not None),
            "weight_sync/engines": float(len(targets) if lead else 0),
            "weight_sync/gbps": delivered / max(seconds, 1e-9) / 1e9,
            "unverifiable": [t.index for t, r, n in zip(targets, reports, compared, strict=True)
                             if r is None or (expected and n == 0)]}


def merge_stats(stats: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The step's weight-sync metrics from every sending rank's :func:`verify_and_report`."""
    if not stats:
        return {}
    unverifiable = {i for s in stats for i in s["unverifiable"]}
    engines = sum(s["weight_sync/engines"] for s in stats)
    out = {k: sum(s[k] for s in stats) for k in ("weight_sync/bytes", "weight_sync/buckets", "weight_sync/engines")}
    # Tensors read back per engine (each sender checks the tensors it sent on each of its engines).
    out["weight_sync/verified_tensors"] = sum(s["verified_checks"] for s in stats) / max(engines, 1)
    # Tensors an engine with TP > 1 answered only in part (its TP rank 0's slice): not verified.
    out["weight_sync/unverified_tensors"] = sum(s["unverified_checks"] for s in stats) / max(engines, 1)
    out["weight_sync/seconds"] = max(s["weight_sync/seconds"] for s in stats)
    out["weight_sync/verified_engines"] = engines - len(unverifiable)
    out["weight_sync/gbps"] = out["weight_sync/bytes"] / max(out["weight_sync/seconds"], 1e-9) / 1e9
    return out
