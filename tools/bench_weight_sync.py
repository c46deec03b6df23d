"""Benchmark: weight sync per transport (megarl.sync) from a TP=2×PP=2 actor on 4 gloo ranks into CPU engine servers.

Rows "weight-sync throughput" and "weight-sync memory" of benchmarks.md, measured on the real path: two of
megarl's CPU engine servers (``--tp-size`` = the actor's TP, so each takes one payload / one group member per
TP rank, as SGLang's ranks do) receive the actor's weights through

- ``tensor``: an engine on each pipeline stage's ranks (one engine per actor TP group); handles to the ranks'
  shared-memory bucket buffers, one ``/update_weights_from_tensor`` per bucket;
- ``distributed``: each stage's TP-0 rank broadcasts its own buckets over a gloo group to both engines.

For each transport, in one run (``--repeats`` rounds, the methods interleaved, the best of each kept; times
are the slowest rank's, barrier to barrier):

- **sync**: ``transport.sync`` with the bucket (verification off; a first sync reads back a sample of eight
  tensors from every engine);
- **per-tensor way**: the same transport with one tensor per bucket (``bucket_bytes=1``);
- **limit**: the transport's own collectives, run alone on the same buckets in the same order and
  concurrency (``tensor``: each bucket's TP all-gathers on its stage as the exporter issues them
  (:meth:`~megarl.convert.export.WeightExporter.gather_ops`), the 1/tp stripes broadcast to the other stage
  and all-gathered there; ``distributed``: each stage at once, its buckets' TP all-gathers and the
  broadcast to as many receivers, threads of another process, as the engines have TP ranks), plus one copy
  of the bytes the sync delivers (every engine loads the model), by one rank alone: what is left of a sync
  without its other copies, serialisation, HTTP and engine work;
- **memory**: resident set size above the baseline on the actor ranks during one sync that creates its
  buffers (sampled every ``--sample-ms``), against the bucket; and what stays for the next sync (the
  ``tensor`` transport's shared-memory buffers).

``gbps``: bytes delivered into all engines / sync seconds (GB = 1e9 B). One line per transport, the last ones:
``RESULT transport=<name> ratio_vs_limit=<x> speedup_vs_per_tensor=<x> peak_over_bucket=<x> gbps=<x>``.

    python tools/bench_weight_sync.py                  # defaults: ~380 MB fp32 model, 64 MiB buckets
    python tools/bench_weight_sync.py --bucket-mb 256
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import math
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_convert holds shared helpers

import bench_convert as common
import torch

import megarl.parallel  # noqa: F401  (before Megatron: silences its CPU fallback warnings in ranks)
from megarl.parallel.cpu_support import all_gather_into_tensor

MB = common.MB
TRANSPORTS = ("tensor", "distributed")
LIVE_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
"""The ranks' allocator: glibc serves every block over 128 KiB by its own mapping and unmaps it when freed (the
default threshold climbs to 32 MiB after the first large free, and freed heap memory stays resident), so the
resident set follows the live buffers, as ``torch.cuda.max_memory_allocated`` would on GPU."""


# --------------------------------------------------------------------------- memory
_PROCESS = None


def _rss() -> int:
    """This process's resident set size in bytes."""
    global _PROCESS
    if _PROCESS is None:
        import psutil

        _PROCESS = psutil.Process()
    return _PROCESS.memory_info().rss


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so the baseline RSS holds no free memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak RSS above the baseline while the block runs (a background thread samples every ``interval_s``)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.peak = self.baseline = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        gc.collect()
        _malloc_trim()
        self.baseline = self.peak = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.baseline)


# ---------------------------------------------------------------------------- limit
def bucket_plan(exporter, bucket_bytes: int) -> list[tuple[int, int, list[int]]]:
    """Per bucket the exporter builds for ``bucket_bytes``, in its order: ``(owner stage, elements rounded up to a
    multiple of tp as its buffers are, elements of each TP all-gather its owner stage runs to fill it: known on
    that stage's ranks only)``."""
    from megarl.convert.param_map import buckets

    tp = exporter.dims.tp
    out = []
    for bucket in buckets(exporter.units, exporter._full_bytes, bucket_bytes):
        numel = sum(exporter._full_bytes(u) for u in bucket) // exporter._element_size
        mine = bucket[0].pp_rank == exporter.groups.pp_rank  # (a rank holds only its own stage's parameters)
        gathers = [tp * sum(exporter.params[u.megatron_name].numel() for u in units)
                   for kind, units in (exporter.gather_ops(bucket) if mine else []) if kind != "copy"]
        out.append((bucket[0].pp_rank, -(-numel // tp) * tp, gathers))
    return out


def _gathers(groups, scratch: torch.Tensor, sizes: list[int]) -> None:
    """The owner stage's TP all-gathers of one bucket (``sizes``: their output elements)."""
    for numel in sizes:
        out = scratch[:numel].view(groups.dims.tp, -1)
        all_gather_into_tensor(out, out[groups.tp_rank], group=groups.tp)


def _tensor_limit_s(groups, plan: list[tuple[int, int, list[int]]]) -> float:
    """The tensor transport's collectives alone, bucket after bucket as it runs them when every stage hosts an
    engine: the owner stage's TP all-gathers filling the bucket, the broadcast of each TP rank's 1/tp stripe
    to the other stages, and their all-gather of the stripes."""
    import torch.distributed as dist

    tp, pp, my_stage = groups.dims.tp, groups.dims.pp, groups.pp_rank
    buffer = torch.ones(max(numel for _, numel, _ in plan))
    scratch = torch.ones(max((n for _, _, sizes in plan for n in sizes), default=1))
    dist.barrier()
    start = time.perf_counter()
    for owner, numel, gathers in plan:
        bucket = buffer[:numel]
        stripe = bucket.view(tp, -1)[groups.tp_rank]
        if owner == my_stage:
            _gathers(groups, scratch, gathers)
        if pp > 1:
            dist.broadcast(stripe, src=dist.get_global_rank(groups.pp, owner), group=groups.pp)
            if owner != my_stage and tp > 1:
                all_gather_into_tensor(bucket, stripe, group=groups.tp)
    dist.barrier()
    return time.perf_counter() - start


def _distributed_limit_s(groups, plan: list[tuple[int, int, list[int]]], receiver_group, repeats: int) -> float:
    """The distributed transport's collectives alone: every stage at once, its buckets in turn: the stage's TP
    all-gathers filling the bucket, then its TP-0 rank's broadcast of the bucket to as many receivers as the
    engines have TP ranks (``receiver_group``: threads of another process, :func:`_receive_broadcasts`); the
    best of ``repeats``."""
    import torch.distributed as dist

    own = [(numel, gathers) for owner, numel, gathers in plan if owner == groups.pp_rank]
    largest = max(numel for numel, _ in own)
    buffer = torch.ones(largest)
    scratch = torch.ones(max((n for _, sizes in own for n in sizes), default=1))
    if receiver_group is not None:
        receiver_group.broadcast(torch.tensor([repeats, len(own), largest], dtype=torch.int64), 0).wait()
        receiver_group.broadcast(torch.tensor([n for n, _ in own], dtype=torch.int64), 0).wait()
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for numel, gathers in own:
            _gathers(groups, scratch, gathers)
            if receiver_group is not None:
                receiver_group.broadcast(buffer[:numel], 0).wait()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def _copy_s(nbytes: int, repeats: int = 3) -> float:
    """One copy of ``nbytes`` into memory that already exists (as the engines' parameters), by this process
    alone (the best of ``repeats``)."""
    source, target = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    target.copy_(source)  # first touch
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


def _receive_broadcasts(host: str, port: int, members: int, world_size: int, name: str) -> None:
    """``members`` receivers of a gloo group (threads of one process, as the CPU engine server's TP ranks): a
    header ``[rounds, buckets, largest]``, the buckets' sizes, then each bucket, round after round."""
    from megarl.engines.weight_group import join_group

    def member(rank: int) -> None:
        group = join_group(host, port, rank, world_size, name)
        header = torch.zeros(3, dtype=torch.int64)
        group.broadcast(header, 0).wait()
        rounds, count, largest = header.tolist()
        sizes = torch.zeros(count, dtype=torch.int64)
        group.broadcast(sizes, 0).wait()
        buffer = torch.empty(largest)
        for _ in range(rounds):
            for numel in sizes.tolist():
                group.broadcast(buffer[:numel], 0).wait()

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(1, members + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# ------------------------------------------------------------------------------ ranks
def sync_rank_job(hf_dir: str, engines: dict[str, list[dict]], bucket_bytes: int, repeats: int, sample_ms: float,
                  tp: int, pp: int, receivers: dict[int, tuple[str, int, int, str]]) -> dict:
    """Everything measured on one rank (see the module docstring)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.convert import WeightExporter, load_hf_into
    from megarl.engines.client import EngineAddress
    from megarl.engines.weight_group import join_group
    from megarl.models import build_model_chunks, family_for
    from megarl.sync import make_transport, verify_sample

    hf_config = AutoConfig.from_pretrained(hf_dir)
    groups = common.init_ranks("cpu", tp, pp)
    family = family_for(hf_config)
    chunks = build_model_chunks(family, hf_config, groups.dims)
    load_hf_into(chunks, hf_dir, family, groups, hf_config=hf_config)
    with torch.no_grad():  # the engines loaded the file: change the weights so a sync has to deliver them
        for chunk in chunks:
            for param in chunk.parameters():
                param.mul_(1.5)
    exporter = WeightExporter(chunks, family, hf_config, groups, dtype=torch.float32)
    # Verified once per transport: a seeded sample of the tensors small enough to read back as JSON quickly.
    small = [n for u in exporter.units for n, shape in zip(u.hf_names, u.hf_shapes) if math.prod(shape) <= 1 << 20]
    names = verify_sample(small, 8, 0)
    total = exporter.total_bytes
    out: dict = {"rank": dist.get_rank(), "total_bytes": total, "transports": {}}
    for name in TRANSPORTS:
        targets = [EngineAddress(**fields) for fields in engines[name]]
        transport = make_transport(name, groups, targets, device="cpu")
        checked = transport.sync(exporter, bucket_bytes=bucket_bytes, version="check", verify_names=names)
        exporter.release_buffers()  # the measured sync creates its buffers, as a first sync does
        with PeakMemory(sample_ms / 1000) as memory:
            transport.sync(exporter, bucket_bytes=bucket_bytes, version="memory")
        kept = max(0, _rss() - memory.baseline)  # what stays for the next sync (the shared-memory ring)
        seconds: dict[str, list[float]] = {"sync": [], "per_tensor": []}
        stats = None
        for round_ in range(repeats):
            for method, size in (("sync", bucket_bytes), ("per_tensor", 1)):
                dist.barrier()
                start = time.perf_counter()
                result = transport.sync(exporter, bucket_bytes=size, version=f"{method}{round_}")
                dist.barrier()
                seconds[method].append(time.perf_counter() - start)
                if method == "sync":
                    stats = result
        transport.close()
        # The limit: the same buckets' collectives, alone, plus one copy of the bytes delivered.
        export = transport.export_args(bucket_bytes)  # what the transport asks of the exporter
        plan = bucket_plan(exporter, export["bucket_bytes"])
        if name == "tensor":
            moved = min(_tensor_limit_s(groups, plan) for _ in range(repeats))
        else:
            group = None
            if groups.tp_rank == 0:  # each stage's sender, joined before the clock starts
                host, port, world_size, group_name = receivers[groups.pp_rank]
                group = join_group(host, port, 0, world_size, group_name)
            moved = _distributed_limit_s(groups, plan, group, repeats)
        # The copy: the bytes the sync delivers (every engine loads the model), by one rank while the others wait.
        dist.barrier()
        copy = _copy_s(total * len(targets)) if dist.get_rank() == 0 else 0.0
        dist.barrier()
        limit = {"collectives": moved, "copy": copy}
        # Where the time goes: the export alone (the transport's buckets built and delivered, no engine).
        dist.barrier()
        start = time.perf_counter()
        for _ in exporter.iter_buckets(**export):
            pass
        dist.barrier()
        limit_export = time.perf_counter() - start
        out["transports"][name] = {"seconds": seconds, "limit": limit, "export": limit_export, "memory": memory.extra,
                                   "kept": kept, "checked": checked, "stats": stats}
    return out


# ------------------------------------------------------------------------------- main
def start_engines(hf_dir: Path, log_dir: Path, tp: int, count: int = 2) -> list:
    """``count`` CPU engine servers on ``hf_dir`` emulating ``tp`` TP ranks each, started and healthy."""
    from megarl.engines.server_process import ServerProcess, free_port

    servers = []
    for index in range(count):
        port = free_port()
        servers.append(ServerProcess(
            [sys.executable, "-m", "megarl.engines.cpu_engine", "--model-path", str(hf_dir), "--port", str(port),
             "--dtype", "float32", "--tp-size", str(tp)], name=f"engine {index}", url=f"http://127.0.0.1:{port}",
            log_path=log_dir / f"engine_{index}.log", env={"OMP_NUM_THREADS": "1"}))
    for server in servers:
        server.start()
    for server in servers:
        server.wait_healthy(300)
    return servers


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the benchmark; print a report ending with one RESULT line per transport; return their numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_arguments(parser, hidden=256, layers=64)
    parser.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MiB (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds, the methods interleaved; the best of each is kept (default: %(default)s)")
    parser.add_argument("--sample-ms", type=float, default=1.0,
                        help="RSS sampling interval of the memory measurement in ms (default: %(default)s)")
    # A Llama by default: the family whose SGLang model answers the transport's read-back (the engines answer as
    # SGLang does: a Qwen2 answers none, and the check would find the engines unverifiable).
    parser.set_defaults(family="llama")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("bench_weight_sync runs the CPU engine servers: --device cpu")
    from megarl.engines.server_process import free_port
    from megarl.models.tiny import build_tiny_tokenizer
    from megarl.parallel.launch import run_ranks

    torch.set_num_threads(1)
    world, tp, pp = args.tp * args.pp, args.tp, args.pp
    hf_config = common.make_hf_config(args)
    bucket_bytes = int(args.bucket_mb * MB)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-sync-"))
    work.mkdir(parents=True, exist_ok=True)
    servers, helpers = [], []
    try:
        hf_dir = work / "hf"
        model_bytes = common.save_random_hf_model(hf_config, hf_dir, shard_mb=10**6)
        build_tiny_tokenizer(min(512, args.vocab)).save_pretrained(hf_dir)  # the engine server loads one
        print(f"model: {args.family} hidden={args.hidden} layers={args.layers} vocab={args.vocab}: "
              f"{model_bytes / MB:.1f} MiB fp32; actor TP={tp}xPP={pp} on {world} gloo ranks; two CPU engine "
              f"servers at TP={tp}; bucket {args.bucket_mb:g} MiB", flush=True)
        servers = start_engines(hf_dir, work, tp)
        first, second = ({"index": i, "url": s.url, "tp": tp} for i, s in enumerate(servers))
        per_stage = world // pp
        engines = {
            "tensor": [{**first, "host_ranks": tuple(range(per_stage))},
                       {**second, "host_ranks": tuple(range(per_stage, 2 * per_stage))}][:pp],
            "distributed": [{**first, "replica": 0}, {**second, "replica": 0}],
        }
        # The distributed limit's receivers: as many group members per stage as the engines' TP ranks.
        import multiprocessing

        receivers = {}
        context = multiprocessing.get_context("spawn")
        for stage in range(pp):
            port, members = free_port(), 2 * tp
            receivers[stage] = ("127.0.0.1", port, members + 1, f"bench_limit_pp{stage}")
            helper = context.Process(target=_receive_broadcasts, args=("127.0.0.1", port, members, members + 1,
                                                                        f"bench_limit_pp{stage}"), daemon=True)
            helper.start()
            helpers.append(helper)
        results = run_ranks(sync_rank_job, world, str(hf_dir), engines, bucket_bytes, args.repeats, args.sample_ms,
                            tp, pp, receivers, timeout_s=args.timeout, env=common.rank_env("cpu") | LIVE_MEMORY)
    finally:
        for helper in helpers:
            helper.join(10)
            if helper.is_alive():
                helper.kill()
        for server in servers:
            server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return report(results, args, bucket_bytes)


def report(results: list[dict], args, bucket_bytes: int) -> dict[str, dict[str, float]]:
    """Print the human-readable report and one RESULT line per transport."""
    from megarl.sync import merge_stats

    total = results[0]["total_bytes"]
    out: dict[str, dict[str, float]] = {}
    lines = []
    for name in TRANSPORTS:
        per_rank = [r["transports"][name] for r in results]
        best = {m: min(max(r["seconds"][m][k] for r in per_rank) for k in range(args.repeats))
                for m in ("sync", "per_tensor")}
        limit_parts = {k: max(r["limit"][k] for r in per_rank) for k in per_rank[0]["limit"]}
        limit = sum(limit_parts.values())
        checked = merge_stats([r["checked"] for r in per_rank if r["checked"] is not None])
        stats = merge_stats([r["stats"] for r in per_rank if r["stats"] is not None])
        exact = checked["weight_sync/verified_engines"] == checked["weight_sync/engines"] > 0 and \
            checked["weight_sync/verified_tensors"] > 0
        peak = max(r["memory"] for r in per_rank)
        gbps = stats["weight_sync/bytes"] / best["sync"] / 1e9
        values = {"ratio_vs_limit": limit / best["sync"], "speedup_vs_per_tensor": best["per_tensor"] / best["sync"],
                  "peak_over_bucket": peak / bucket_bytes, "gbps": gbps, "sync_s": best["sync"],
                  "per_tensor_s": best["per_tensor"], "limit_s": limit, "bit_exact": float(exact)}
        out[name] = values
        print(f"{name}: sync {best['sync']:.3f} s ({gbps:.3f} GB/s into {stats['weight_sync/engines']:.0f} engines, "
              f"{stats['weight_sync/buckets']:.0f} buckets), every tensor verified: {exact}")
        print(f"  limit {limit:.3f} s = " + " + ".join(f"{k} {v:.3f}" for k, v in limit_parts.items())
              + f" -> ratio {values['ratio_vs_limit']:.2f} (bar >= 0.5 {common.bar(values['ratio_vs_limit'] >= 0.5)})")
        print(f"  the export alone (buckets built and delivered, no engine): {max(r['export'] for r in per_rank):.3f} s")
        print(f"  per-tensor way {best['per_tensor']:.3f} s -> speedup {values['speedup_vs_per_tensor']:.2f}x "
              f"(bar >= 3x {common.bar(values['speedup_vs_per_tensor'] >= 3)})")
        print(f"  memory above the model on the actor ranks: peak {peak / MB:.1f} MiB = "
              f"{values['peak_over_bucket']:.2f}x the {bucket_bytes / MB:g} MiB bucket "
              f"(bar <= 1.25x {common.bar(values['peak_over_bucket'] <= 1.25)}); kept for the next sync "
              f"{max(r['kept'] for r in per_rank) / MB:.1f} MiB")
        lines.append("RESULT transport=" + name + " " + common.result_line(values).removeprefix("RESULT "))
    print(f"model bytes per engine: {total / MB:.1f} MiB")
    for line in lines:
        print(line, flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
