"""Rank-side job of the weight-transport tests (imported by spawned ranks): a TP=2×PP=2 actor streams its weights
into real CPU engine servers (``--tp-size 2``) through each transport of :mod:`megarl.sync`."""

from __future__ import annotations

import zlib

import torch

TP, PP = 2, 2
BUCKET_BYTES = 16 * 1024
"""Small buckets: the tiny model travels in dozens of them, so double buffering is exercised."""


def perturb(chunks, step: int) -> None:
    """Change every parameter (the engines start from the HF file: a sync that delivers nothing must fail).
    Seeded by parameter name and step, so the copies of a replicated tensor (norms on every TP rank) stay equal."""
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                generator = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}".encode()))
                param.add_(torch.randn(param.shape, generator=generator) * 0.01)


def transports_job(hf_dir: str, cases: list[tuple[str, list[dict]]]) -> dict:
    """For each ``(transport, engines)`` case (engines as :class:`EngineAddress` fields): perturb the weights, sync
    them with every tensor verified (as far as the engines answer ``/get_weights_by_name``), and read them whole from
    every engine (``/megarl/inspect_weight``) to compare with an independent full
    export. Returns per case this rank's statistics and (on rank 0) the read-back result."""
    from megarl.engines import event_loop

    with event_loop.holding():  # the rank's event loop, for the transports and the read-back alike
        return _transports(hf_dir, cases)


def _actor(hf_dir: str):
    """``(family, hf_config, groups, chunks, exporter)``: the TP×PP actor of ``hf_dir`` on this rank, its fp32 export."""
    from transformers import AutoConfig

    from megarl.convert import WeightExporter
    from megarl.convert.loader import load_hf_into
    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, init_parallel

    cfg = AutoConfig.from_pretrained(hf_dir)
    family = family_for(cfg)
    groups = init_parallel(ParallelDims(tp=TP, pp=PP))
    chunks = build_model_chunks(family, cfg, groups.dims)
    load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
    return family, cfg, groups, chunks, WeightExporter(chunks, family, cfg, groups, dtype=torch.float32)


def _transports(hf_dir: str, cases: list[tuple[str, list[dict]]]) -> dict:
    import torch.distributed as dist

    from megarl.engines.client import EngineAddress, gather_sync
    from megarl.engines.cpu_engine.read_back import inspect_weight
    from megarl.sync import make_transport

    _, _, groups, chunks, exporter = _actor(hf_dir)
    out: dict = {"rank": dist.get_rank(), "cases": []}
    # Buckets for TP rank 0 only (the distributed transport's senders): the other TP ranks join the all-gathers.
    full = {n: t.clone() for bucket in exporter.iter_full(1 << 30) for n, t in bucket}
    names, differ = [], []
    for bucket in exporter.iter_buckets(BUCKET_BYTES, to_pp_ranks=(), tp_ranks=(0,)):
        names += bucket.names
        differ += [n for n, t in bucket.named() if not torch.equal(t, full[n])]
    out["first_tp_only"] = {"names": names, "differ": differ, "stage_names": sorted(
        n for u in exporter.units if u.pp_rank == groups.pp_rank for n in u.hf_names)}
    try:
        next(exporter.iter_buckets(BUCKET_BYTES, tp_ranks=(0,)))
    except ValueError as error:
        out["first_tp_only"]["refused"] = str(error)
    for index, (name, engine_fields) in enumerate(cases):
        engines = [EngineAddress(**fields) for fields in engine_fields]
        transport = make_transport(name, groups, engines, device="cpu")
        posts = _record_posts(transport) if name == "distributed" else None
        stats, rings = [], []
        for attempt in range(2):  # the second sync reuses the groups and buffers of the first
            perturb(chunks, 2 * index + attempt)
            truth = {n: t.clone() for bucket in exporter.iter_full(1 << 20) for n, t in bucket}
            # The transport reads every tensor back the first time; rank 0 does it itself after the second.
            stats.append(transport.sync(exporter, bucket_bytes=BUCKET_BYTES, version=f"v{index}.{attempt}",
                                        verify_names=list(truth) if attempt == 0 else []))
            kept = exporter._kept_ring  # the shared-memory bucket buffers kept for the next sync
            rings.append(None if kept is None else [b.untyped_storage().data_ptr() for b in kept])
        transport.close()
        case = {"transport": name, "stats": stats, "names": len(truth), "rings": rings, "posts": posts}
        dist.barrier()
        if dist.get_rank() == 0:
            differ = []
            for engine in engines:  # whole, as held (the engines' own read: SGLang's answers only Llama's, in part)
                for tensor_name, tensor in truth.items():
                    if not torch.equal(gather_sync([inspect_weight(engine.url, tensor_name)])[0].float(), tensor):
                        differ.append((engine.name, tensor_name))
            case["differ"] = differ
            case["max_change"] = max((truth[n] - _original(hf_dir)[n]).abs().max().item() for n in truth)
        out["cases"].append(case)
        dist.barrier()
    return out


def _record_posts(transport) -> list[tuple[float, float]]:
    """Record, on this rank, each ``/update_weights_from_distributed`` request of ``transport`` to any engine: when it
    was sent and when its answer came (``time.monotonic``: one clock for every process of the machine)."""
    import time

    posts: list[tuple[float, float]] = []
    for engine in transport.targets:
        client = transport.client(engine)
        post = client.update_weights_from_distributed

        async def recorded(*args, _post=post, **kwargs):
            sent = time.monotonic()
            answer = await _post(*args, **kwargs)
            posts.append((sent, time.monotonic()))
            return answer

        client.update_weights_from_distributed = recorded
    return posts


_ORIGINAL: dict = {}


def _original(hf_dir: str) -> dict:
    if hf_dir not in _ORIGINAL:
        from safetensors.torch import load_file

        _ORIGINAL[hf_dir] = load_file(f"{hf_dir}/model.safetensors")
    return _ORIGINAL[hf_dir]


def fp8_transports_job(hf_dir: str, cases: list[tuple[str, list[dict]]]) -> dict:
    """For each ``(transport, engines)`` case, into engines serving block FP8: perturb the weights and sync them
    quantized (``quantization=fp8``), every tensor and scale verified by the transport (as far as the engines
    answer); rank 0 then reads every quantized weight and scale whole from every engine (``/megarl/inspect_weight``)
    against the full export quantized here."""
    from megarl.engines import event_loop

    with event_loop.holding():
        return _fp8_transports(hf_dir, cases)


def _fp8_transports(hf_dir: str, cases: list[tuple[str, list[dict]]]) -> dict:
    import torch.distributed as dist

    from megarl.convert.fp8 import fp8_names
    from megarl.engines.client import EngineAddress, gather_sync
    from megarl.engines.cpu_engine.read_back import inspect_weight
    from megarl.models.fp8 import quantize_block_fp8, scale_name
    from megarl.sync import make_transport

    family, cfg, groups, chunks, exporter = _actor(hf_dir)
    quantized = fp8_names(family, cfg)
    out: dict = {"rank": dist.get_rank(), "cases": []}
    for index, (name, engine_fields) in enumerate(cases):
        engines = [EngineAddress(**fields) for fields in engine_fields]
        transport = make_transport(name, groups, engines, device="cpu", quantization="fp8")
        perturb(chunks, 10 + index)
        truth = {n: t.clone() for bucket in exporter.iter_full(1 << 20) for n, t in bucket}
        stats = transport.sync(exporter, bucket_bytes=BUCKET_BYTES, version=f"fp8.{index}", verify_names=list(truth))
        transport.close()
        case = {"transport": name, "stats": stats, "names": len(truth), "quantized": len(quantized)}
        dist.barrier()
        if dist.get_rank() == 0:
            expected = {}
            for tensor_name in sorted(quantized):
                weight, scale = quantize_block_fp8(truth[tensor_name])
                expected[tensor_name], expected[scale_name(tensor_name)] = weight.float(), scale.float()
            differ, values = [], 0
            for engine in engines:
                for tensor_name, tensor in expected.items():
                    values += tensor.numel()
                    if not torch.equal(gather_sync([inspect_weight(engine.url, tensor_name)])[0].float(), tensor):
                        differ.append((engine.name, tensor_name))
            original = _original(hf_dir)
            case.update(differ=differ, values=values, read=len(expected) * len(engines),
                        moved=[n for n in quantized if not torch.equal(quantize_block_fp8(original[n].float())[0]
                                                                       .float(), expected[n])])
        out["cases"].append(case)
        dist.barrier()
    return out


def adapter_payloads_job() -> dict:
    """Two actor ranks (TP=2) hosting one colocated engine of TP 2: the adapters sync's payloads, as its sender would
    post them (the engine request recorded instead of sent), and the process that made each one's buffer. Returns
    this rank's pid and, on the sender, each payload's shared-memory file name."""
    import os

    import torch.distributed as dist
    from sglang.srt.utils import MultiprocessingSerializer

    from megarl.engines import event_loop
    from megarl.engines.client import EngineAddress
    from megarl.parallel import ParallelDims, init_parallel
    from megarl.sync.adapters import AdapterSync

    groups = init_parallel(ParallelDims(tp=2))
    posted: list = []

    class Adapters:  # what WeightExporter.adapters() gives every rank: the whole adapter
        @staticmethod
        def adapters():
            return [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.ones(4, 8))]

    with event_loop.holding():
        sync = AdapterSync(groups, [EngineAddress(index=0, url="http://127.0.0.1:9", tp=2, host_ranks=(0, 1))],
                           config={})

        async def record(engine, payloads, sums, version):
            posted.append([MultiprocessingSerializer.deserialize(p)["flattened_tensor"].untyped_storage()
                           ._share_filename_cpu_()[1].decode() for p in payloads])

        sync._load = record
        sync._sync(Adapters(), bucket_bytes=1 << 20, version="1")
        sync.close()
    return {"rank": dist.get_rank(), "pid": os.getpid(), "posted": posted}
