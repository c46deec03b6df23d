"""Benchmark: weight sync from a TP=2×PP=2 Megatron actor into a rollout engine, on 4 gloo ranks.

Rows "weight-sync throughput" and "weight-sync memory" of benchmarks.md. There is no engine
class yet; the engine is modelled as what the CPU engine will be: an HF transformers model
on each rank whose parameters receive ``param.copy_(tensor)`` for every delivered
``(name, tensor)``. One run measures, side by side on the same 4 ranks (each method runs
``--repeats`` times, interleaved with the others; the best time of each is kept):

- **bucketed**: ``WeightExporter.iter_full(bucket)`` (pipeline stages take turns, TP shards
  gathered, one broadcast per bucket), every tensor copied into the engine;
- **copy limit** (a): the same HF tensors copied once into the engine from a ready dict
  of HF tensors in memory: no conversion, no communication;
- **naive** (b): one tensor at a time, written here: a full TP all-gather of each
  Megatron parameter, the transforms undone, then a separate pipeline broadcast of each
  HF tensor before its copy;
- **TP-matched shards**: ``WeightExporter.iter_shards(bucket)`` into a TP=2 engine's
  shard tensors (no all-gather; about half the bytes per rank).

GB/s is bytes delivered into each rank's engine / wall time (slowest rank, between
barriers), with GB = 1e9 bytes.

Memory: resident set size (psutil, sampled every ``--sample-ms`` in a background thread)
during one bucketed sync, above the RSS just before it (after the engine and the actor are
built, garbage collected and ``malloc_trim``-ed), slowest rank. It is compared with the
bucket size, and is also reported per bucket (the window from one bucket's arrival to the
next's), so a tensor larger than the bucket (the embedding of a large vocabulary travels
alone) can be told apart from the regular buckets. On ``--device cuda`` the peak comes from
the CUDA allocator instead.

A breakdown pass times the parts of ``iter_full`` (all-gather, unfuse + concatenate,
bucket fill, pipeline broadcast, engine copy) and raw gloo bandwidth, to show where time goes.

Run from anywhere::

    python tools/bench_weight_sync.py                  # defaults: ~380 MB fp32 model, 64 MiB buckets
    python tools/bench_weight_sync.py --bucket-mb 256

The last line is ``RESULT name=value ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
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

MB = common.MB


# ------------------------------------------------------------------------- delivery
@torch.no_grad()
def deliver(buckets, targets: dict[str, torch.Tensor], on_bucket=None) -> int:
    """Copy every ``(name, tensor)`` of every bucket into ``targets[name]``; return bytes copied.

    Like an engine, it keeps no reference to a bucket once copied, so memory held while the
    next bucket is produced is the exporter's own.
    """
    nbytes = 0
    for bucket in buckets:
        size = 0
        for name, tensor in bucket:
            targets[name].copy_(tensor)
            size += tensor.numel() * tensor.element_size()
        del bucket, name, tensor
        nbytes += size
        if on_bucket is not None:
            on_bucket(size)
    return nbytes


@torch.no_grad()
def naive_sync(exporter, groups, targets: dict[str, torch.Tensor]) -> int:
    """The one-tensor-at-a-time reference: full TP all-gather per parameter, one broadcast per tensor."""
    import torch.distributed as dist

    from megarl.convert.layout import hf_split_dim, unfuse

    tp, pp = groups.dims.tp, groups.dims.pp
    nbytes = 0
    for unit in exporter.units:  # every Megatron parameter of the model, in HF order
        owner = unit.pp_rank == groups.pp_rank
        if owner:
            shard = exporter.params[unit.megatron_name].detach()
            gathered = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(gathered, shard.contiguous(), group=groups.tp)
            per_rank = [unfuse(unit.rule, s, exporter.sizes, r, tp) for r, s in enumerate(gathered)]
            dim = hf_split_dim(unit.rule)
            full = per_rank[0] if dim is None else [torch.cat([p[k] for p in per_rank], dim=dim) for k in range(len(unit.hf_names))]
        for k, (name, shape) in enumerate(zip(unit.hf_names, unit.hf_shapes)):
            target = targets[name]
            tensor = full[k].contiguous() if owner else torch.empty(shape, dtype=target.dtype, device=target.device)
            if pp > 1:
                dist.broadcast(tensor, src=dist.get_global_rank(groups.pp, unit.pp_rank), group=groups.pp)
            target.copy_(tensor)
            nbytes += tensor.numel() * tensor.element_size()
    return nbytes


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
    """Peak memory above a baseline while the block runs, overall and per window.

    On CPU: process RSS sampled every ``interval_s`` by a background thread. On CUDA: the
    allocator's peak. :meth:`window` returns the peak since the previous call and starts a
    new window (used once per bucket).
    """

    def __init__(self, device: str, interval_s: float):
        self.device, self.interval_s = device, interval_s
        self.peak = self.baseline = 0
        self._window_peak = 0
        self._stop = threading.Event()
        self._thread = None

    def _now(self) -> int:
        return torch.cuda.memory_allocated() if self.device == "cuda" else _rss()

    def __enter__(self):
        gc.collect()
        _malloc_trim()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.baseline = self.peak = self._window_peak = self._now()
        if self.device == "cpu":
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            value = _rss()
            self.peak = max(self.peak, value)
            self._window_peak = max(self._window_peak, value)
            time.sleep(self.interval_s)

    def window(self) -> int:
        """Peak above the baseline since the last call (CPU; on CUDA the running peak)."""
        if self.device == "cuda":
            return torch.cuda.max_memory_allocated() - self.baseline
        value = _rss()
        peak, self._window_peak = max(self._window_peak, value), value
        self.peak = max(self.peak, peak)
        return max(0, peak - self.baseline)

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        """Peak above the baseline, in bytes (never negative)."""
        return max(0, self.peak - self.baseline)


def measure_memory(buckets_fn, targets, device: str, interval_s: float) -> dict:
    """One sync under :class:`PeakMemory`: overall peak and the (bucket bytes, window peak) pairs."""
    windows = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, interval_s / 2))  # let the sampler in while Python code runs
    try:
        with PeakMemory(device, interval_s) as mem:
            deliver(buckets_fn(), targets, on_bucket=lambda size: windows.append((size, mem.window())))
    finally:
        sys.setswitchinterval(switch)
    return {"extra": mem.extra, "baseline": mem.baseline, "windows": windows}


# -------------------------------------------------------------------------- breakdown
class _Timer:
    """Seconds accumulated per label."""

    def __init__(self, device: str):
        self.device = device
        self.seconds: dict[str, float] = {}

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                common.synchronize(self.device)
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        return timed


def breakdown_pass(exporter, targets, bucket_bytes: int, device: str) -> dict[str, float]:
    """One ``iter_full`` sync with its parts timed (seconds on this rank, waits included).

    Parts: ``all_gather`` (gloo/nccl), ``unfuse_copy`` (the rest of gathering a parameter:
    unfusing the shards and writing them into the bucket buffer), ``broadcast`` (pipeline
    broadcast of the bucket), ``engine_copy``.
    """
    from megarl.convert import export

    timer = _Timer(device)
    original_all_gather = export._all_gather
    export._all_gather = timer.wrap("all_gather", original_all_gather)  # restored below
    exporter._gather_into = timer.wrap("gather", exporter._gather_into)
    exporter._broadcast = timer.wrap("broadcast", exporter._broadcast)
    try:
        torch.distributed.barrier()
        start = time.perf_counter()
        copy_s = 0.0
        with torch.no_grad():
            for bucket in exporter.iter_full(bucket_bytes):
                t = time.perf_counter()
                for name, tensor in bucket:
                    targets[name].copy_(tensor)
                common.synchronize(device)
                copy_s += time.perf_counter() - t
        total = time.perf_counter() - start
    finally:
        export._all_gather = original_all_gather
        for attr in ("_gather_into", "_broadcast"):
            del exporter.__dict__[attr]
    s = timer.seconds
    parts = {
        "all_gather": s.get("all_gather", 0.0),
        "unfuse_copy": s.get("gather", 0.0) - s.get("all_gather", 0.0),
        "broadcast": s.get("broadcast", 0.0),
        "engine_copy": copy_s,
    }
    parts["other"] = total - sum(parts.values())
    parts["total"] = total
    return parts


def transport_bandwidth(groups, device: str, nbytes: int) -> dict[str, float]:
    """GB/s of the collectives alone, all groups at once as in a sync (barrier to barrier, best of 3).

    ``broadcast``: ``nbytes`` over each pipeline group; ``all_gather``: ``nbytes`` of output
    over each TP group; ``clone``: a local copy of ``nbytes`` (fresh memory, as a gather
    output is). A group of one rank is skipped.
    """
    import torch.distributed as dist

    tp, pp = groups.dims.tp, groups.dims.pp
    buf = torch.ones(nbytes // 4, device="cuda" if device == "cuda" else "cpu")
    part = buf[: buf.numel() // tp]
    ops = {"clone": lambda: buf.clone()}
    if pp > 1:
        ops["broadcast"] = lambda: dist.broadcast(buf, src=dist.get_global_rank(groups.pp, 0), group=groups.pp)
    if tp > 1:
        ops["all_gather"] = lambda: dist.all_gather([torch.empty_like(part) for _ in range(tp)], part, group=groups.tp)
    out = {}
    for label, fn in ops.items():
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            fn()
            common.synchronize(device)
            dist.barrier()
            best = min(best, time.perf_counter() - start)
        out[label] = nbytes / best / 1e9
    return out


# ------------------------------------------------------------------------------ ranks
def sync_rank_job(
    hf_dir: str, bucket_bytes: int, repeats: int, device: str, sample_ms: float, tp: int, pp: int
) -> dict:
    """Everything measured on one rank (see the module docstring); returns its numbers."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.convert import WeightExporter, load_hf_into
    from megarl.convert.hf_io import HFCheckpoint
    from megarl.convert.layout import Slice
    from megarl.models import build_model_chunks, family_for

    hf_config = AutoConfig.from_pretrained(hf_dir)
    groups = common.init_ranks(device, tp, pp)
    family = family_for(hf_config)
    chunks = build_model_chunks(family, hf_config, groups.dims)
    load_hf_into(chunks, hf_dir, family, groups, hf_config=hf_config)
    torch_device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    engine = AutoModelForCausalLM.from_config(hf_config).float().to(torch_device).eval()  # random until synced
    targets = {name: p for name, p in engine.named_parameters()}
    exporter = WeightExporter(chunks, family, hf_config, groups)
    out = {"total_bytes": exporter.total_bytes, "rank": groups.rank}

    # 1. Memory of one bucketed sync, first thing after the set-up; it also checks correctness.
    full = measure_memory(lambda: exporter.iter_full(bucket_bytes), targets, device, sample_ms / 1000)
    out["mem_full"] = full
    checkpoint = HFCheckpoint(hf_dir)
    expected = set(checkpoint.names()) - ({"lm_head.weight"} if hf_config.tie_word_embeddings else set())
    out["engine_bit_exact"] = set(targets) == expected and all(
        torch.equal(targets[n].cpu(), checkpoint.read(n, Slice(None))) for n in targets
    )
    shard_targets = {n: t.clone() for b in exporter.iter_shards(bucket_bytes) for n, t in b}  # TP-matched engine's
    out["mem_shards"] = measure_memory(lambda: exporter.iter_shards(bucket_bytes), shard_targets, device, sample_ms / 1000)
    out["shard_bytes"] = sum(t.numel() * t.element_size() for t in shard_targets.values())

    # 2. Throughput, the methods interleaved.
    # The ready HF tensors, in ordinary memory (safetensors would hand out views of the mapped file).
    source = {n: checkpoint.read(n, Slice(None)).to(torch_device, copy=True) for n in targets}
    methods = {
        "bucketed": lambda: deliver(exporter.iter_full(bucket_bytes), targets),
        "copy": lambda: deliver([source.items()], targets),
        "naive": lambda: naive_sync(exporter, groups, targets),
        "shards": lambda: deliver(exporter.iter_shards(bucket_bytes), shard_targets),
    }
    seconds = {name: [] for name in methods}
    delivered = {}
    for _ in range(repeats):
        for name, fn in methods.items():
            dist.barrier()
            start = time.perf_counter()
            delivered[name] = fn()
            common.synchronize(device)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    out["seconds"], out["delivered"] = seconds, delivered
    out["engine_bit_exact_after"] = all(torch.equal(targets[n], source[n]) for n in targets)
    source.clear()
    gc.collect()

    # 3. Where the bucketed sync's time goes, and what the transport does on its own.
    out["breakdown"] = breakdown_pass(exporter, targets, bucket_bytes, device)
    out["transport"] = transport_bandwidth(groups, device, bucket_bytes)
    out["num_buckets"] = len(full["windows"])
    return out


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; print a report ending with the RESULT line; return its numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_arguments(parser)
    parser.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MiB (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each method, interleaved; the best is kept (default: %(default)s)")
    parser.add_argument("--sample-ms", type=float, default=1.0,
                        help="RSS sampling interval of the memory measurement in ms (default: %(default)s)")
    args = parser.parse_args(argv)
    from megarl.parallel.launch import run_ranks

    torch.set_num_threads(1)
    world = args.tp * args.pp
    common.check_device(args.device, world)
    hf_config = common.make_hf_config(args)
    bucket_bytes = int(args.bucket_mb * MB)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-sync-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hf_dir = work / "hf"
        model_bytes = common.save_random_hf_model(hf_config, hf_dir, shard_mb=10**6)
        print(
            f"model: {args.family} hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
            f"intermediate={hf_config.intermediate_size} heads={hf_config.num_attention_heads}/"
            f"{hf_config.num_key_value_heads} tied={args.tied}: {model_bytes / MB:.1f} MiB fp32; "
            f"actor TP={args.tp}xPP={args.pp} on {world} ranks ({args.device}), bucket {args.bucket_mb:g} MiB"
        )
        results = run_ranks(
            sync_rank_job, world, str(hf_dir), bucket_bytes, args.repeats, args.device, args.sample_ms,
            args.tp, args.pp, timeout_s=args.timeout, env=common.rank_env(args.device),
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return report(results, args, bucket_bytes)


def report(results: list[dict], args, bucket_bytes: int) -> dict[str, float]:
    """Print the human-readable report and the RESULT line."""
    total = results[0]["total_bytes"]
    best = {name: min(max(r["seconds"][name][k] for r in results) for k in range(args.repeats)) for name in results[0]["seconds"]}
    for r in results:
        assert r["delivered"]["bucketed"] == r["delivered"]["copy"] == r["delivered"]["naive"] == total, "bytes differ"
    shard_bytes = max(r["shard_bytes"] for r in results)
    gbps = {name: total / s / 1e9 for name, s in best.items() if name != "shards"}
    gbps["shards"] = shard_bytes / best["shards"] / 1e9
    exact = all(r["engine_bit_exact"] and r["engine_bit_exact_after"] for r in results)

    peak_extra = max(r["mem_full"]["extra"] for r in results)
    windows = [w for r in results for w in r["mem_full"]["windows"]]
    largest_bucket = max(size for size, _ in windows)
    regular = [peak for size, peak in windows if size <= bucket_bytes]
    oversize = [(size, peak) for size, peak in windows if size > bucket_bytes]
    peak_regular = max(regular) if regular else 0
    shard_peak = max(r["mem_shards"]["extra"] for r in results)

    ratio_copy = gbps["bucketed"] / gbps["copy"]
    speedup = best["naive"] / best["bucketed"]
    over = peak_extra / bucket_bytes
    print(f"delivered per rank: {total / MB:.1f} MiB in {results[0]['num_buckets']} buckets (full); "
          f"{shard_bytes / MB:.1f} MiB (TP-matched shards); engine bit-exact after sync: {exact}")
    print(f"best of {args.repeats}, slowest rank:")
    print(f"  bucketed iter_full  {best['bucketed']:.3f} s  {gbps['bucketed']:.3f} GB/s")
    print(f"  (a) copy limit      {best['copy']:.3f} s  {gbps['copy']:.3f} GB/s  -> ratio {ratio_copy:.2f} "
          f"(bar >= 0.5 {common.bar(ratio_copy >= 0.5)})")
    print(f"  (b) naive           {best['naive']:.3f} s  {gbps['naive']:.3f} GB/s  -> speedup {speedup:.2f}x "
          f"(bar >= 3x {common.bar(speedup >= 3)})")
    print(f"  TP-matched shards   {best['shards']:.3f} s  {gbps['shards']:.3f} GB/s per rank "
          f"({best['bucketed'] / best['shards']:.2f}x faster than full)")
    print(f"memory above the model during the bucketed sync (slowest rank): peak {peak_extra / MB:.1f} MiB "
          f"= {over:.2f}x the {bucket_bytes / MB:g} MiB bucket (bar <= 1.25x {common.bar(over <= 1.25)}); "
          f"largest bucket {largest_bucket / MB:.1f} MiB")
    print(f"  windows of buckets within the bucket size: peak {peak_regular / MB:.1f} MiB "
          f"= {peak_regular / bucket_bytes:.2f}x bucket")
    if oversize:
        size, peak = max(oversize, key=lambda w: w[1])
        print(f"  windows of the {len(oversize) // len(results)} bucket(s) holding one tensor larger than the bucket: "
              f"peak {peak / MB:.1f} MiB = {peak / size:.2f}x that {size / MB:.1f} MiB tensor")
    print(f"  TP-matched shards sync: peak {shard_peak / MB:.1f} MiB")
    print("where the bucketed sync's time goes (seconds on each rank, waits included):")
    keys = list(results[0]["breakdown"])
    print("  rank " + " ".join(f"{k:>17}" for k in keys))
    for r in results:
        print(f"  {r['rank']:>4} " + " ".join(f"{r['breakdown'][k]:>17.3f}" for k in keys))
    transport = {k: min(r["transport"][k] for r in results) for k in results[0]["transport"]}
    print(f"collectives alone, {bucket_bytes / MB:g} MiB, all groups at once (slowest rank): "
          + ", ".join(f"{k} {v:.2f} GB/s" for k, v in transport.items()))
    values = {
        "weight_sync_gbps": gbps["bucketed"],
        "copy_limit_gbps": gbps["copy"],
        "ratio_vs_copy": ratio_copy,
        "naive_gbps": gbps["naive"],
        "speedup_vs_naive": speedup,
        "shards_gbps": gbps["shards"],
        "shards_mb_per_rank": shard_bytes / MB,
        "shards_speedup_vs_full": best["bucketed"] / best["shards"],
        "total_mb": total / MB,
        "peak_extra_mb": peak_extra / MB,
        "bucket_mb": bucket_bytes / MB,
        "peak_over_bucket": over,
        "largest_bucket_mb": largest_bucket / MB,
        "peak_regular_over_bucket": peak_regular / bucket_bytes,
        "shards_peak_extra_mb": shard_peak / MB,
        "bit_exact": int(exact),
    }
    print(common.result_line(values), flush=True)
    return {k: float(v) for k, v in values.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
