"""Benchmark: HF <-> Megatron checkpoint conversion at TP=2×PP=2, against plain file I/O.

Rows "HF→Megatron conversion" and "Megatron→HF export" of benchmarks.md. One run measures,
side by side:

- **HF→Megatron**: on 4 gloo ranks (TP=2×PP=2), ``load_hf_into`` (each rank reads only its
  slices of the safetensors files) then ``save_dist_checkpoint`` (Megatron torch_dist).
  Timed inside the ranks from a barrier to the end of the save; the figure is the slowest
  rank. Building the (randomly initialised) model chunks is not timed.
- **Megatron→HF export**: on 4 fresh ranks' chunks, ``load_dist_checkpoint``, then
  ``WeightExporter.iter_full`` with rank 0 writing sharded safetensors through
  ``ShardedWriter`` (plan construction included).
- **I/O-only reference** (single process, one torch thread): read the same safetensors
  files fully, then write the same bytes with ``torch.save`` (safetensors memory-maps the
  files, so the bytes are read as ``torch.save`` serialises them). Measured twice: plain, and
  followed by ``os.fsync`` of the written file, because Megatron's torch_dist writer fsyncs
  every file it writes while ``safetensors.save_file`` (the export) does not.

The exported checkpoint is compared with the original tensor for tensor (bit-exact, names
equal); the round trip HF→Megatron→HF checks both directions.

The model is a random Qwen2 (or Llama) architecture built from transformers' config
classes; ``--hidden/--layers/--vocab`` size it. Each measurement runs ``--repeats`` times
and the best time of each is kept (the reference too). ``--tp/--pp`` change the layout
(the smoke test uses 2 ranks); the benchmark row is TP=2×PP=2.

Run from anywhere::

    python tools/bench_convert.py                 # defaults: ~400 MB fp32, a few minutes on 2 cores
    python tools/bench_convert.py --hidden 256 --layers 4 --vocab 8000

The last line is ``RESULT name=value ...``. This module also holds the helpers that
``tools/bench_weight_sync.py`` shares (random checkpoint, rank set-up, RESULT formatting).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import megarl.parallel  # noqa: F401  (imported before Megatron: silences its CPU fallback warnings in ranks)

MB = 2**20


# ----------------------------------------------------------------------- shared helpers
def add_model_arguments(parser: argparse.ArgumentParser, *, hidden=768, layers=8, vocab=32000) -> None:
    """The options that size the random benchmark model and choose the device."""
    group = parser.add_argument_group("model (random weights, transformers config classes)")
    group.add_argument("--family", choices=["qwen2", "llama"], default="qwen2",
                       help="architecture: qwen2 (q/k/v biases) or llama (default: %(default)s)")
    group.add_argument("--hidden", type=int, default=hidden, help="hidden size (default: %(default)s)")
    group.add_argument("--layers", type=int, default=layers,
                       help="number of transformer layers, a multiple of --pp (default: %(default)s)")
    group.add_argument("--vocab", type=int, default=vocab, help="vocabulary size (default: %(default)s)")
    group.add_argument("--intermediate", type=int, default=None,
                       help="MLP size (default: 8/3 × hidden rounded up to a multiple of 256, or of 64 when small)")
    group.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 64, at least 2)")
    group.add_argument("--kv-heads", type=int, default=None,
                       help="key/value heads, a multiple of --tp dividing --heads (default: 4 when that divides "
                            "--heads, else 2)")
    group.add_argument("--tied", action="store_true", help="tie input and output embeddings (default: untied)")
    layout = parser.add_argument_group("actor layout (benchmarks.md's rows are for TP=2 x PP=2 on 4 ranks)")
    layout.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: %(default)s)")
    layout.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default: %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the ranks keep the model: cpu (gloo, default) or cuda (nccl, one GPU per "
                             "rank: needs tp x pp GPUs)")
    parser.add_argument("--workdir", default=None,
                        help="directory for the temporary checkpoints (default: a new temp dir, removed at the end)")
    parser.add_argument("--timeout", type=float, default=900.0, help="limit for the rank job in seconds (default: %(default)s)")


def make_hf_config(args: argparse.Namespace):
    """A transformers config (Qwen2Config or LlamaConfig) from the size options."""
    from transformers import LlamaConfig, Qwen2Config

    heads = args.heads or max(2, args.hidden // 64)
    if heads % 2:
        heads += 1
    kv_heads = args.kv_heads or (4 if heads % 4 == 0 else 2)
    if args.hidden % heads or heads % kv_heads or kv_heads % args.tp:
        raise ValueError(
            f"--heads={heads} and --kv-heads={kv_heads} must divide --hidden={args.hidden} and each other, "
            f"with --kv-heads a multiple of --tp={args.tp}"
        )
    if args.layers % args.pp:
        raise ValueError(f"--layers={args.layers} must be a multiple of --pp={args.pp}")
    step = 256 if args.hidden >= 384 else 64
    intermediate = args.intermediate or step * math.ceil(8 * args.hidden / 3 / step)
    common = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": bool(args.tied),
    }
    if args.family == "qwen2":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    return LlamaConfig(**common, architectures=["LlamaForCausalLM"])


def save_random_hf_model(hf_config, directory: str | os.PathLike, *, shard_mb: int, seed: int = 0) -> int:
    """Save a random fp32 model of ``hf_config`` with ``save_pretrained``; return its tensor bytes.

    Norm weights and biases are randomised too, so that a misplaced tensor cannot pass the
    bit-exactness check by being all ones or zeros.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory, max_shard_size=f"{shard_mb}MB")
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return nbytes


def safetensors_files(directory: str | os.PathLike) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint directory, sorted."""
    return sorted(Path(directory).glob("*.safetensors"))


def rank_env(device: str) -> dict[str, str]:
    """Environment for spawned ranks: on ``cpu``, hide GPUs so Megatron builds CPU parameters."""
    return {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}


def check_device(device: str, world_size: int) -> None:
    """Refuse ``--device cuda`` without one GPU per rank (nccl cannot share a GPU between ranks)."""
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise SystemExit(
            f"--device cuda needs {world_size} GPUs (one per rank, nccl); found {torch.cuda.device_count()}. "
            "Use --device cpu."
        )


def init_ranks(device: str, tp: int, pp: int):
    """``init_parallel`` at ``tp`` × ``pp`` with gloo (cpu) or nccl (cuda); returns the groups."""
    from megarl.parallel import ParallelDims, init_parallel

    return init_parallel(ParallelDims(tp=tp, pp=pp), backend="gloo" if device == "cpu" else "nccl")


def synchronize(device: str) -> None:
    """Wait for queued GPU work (a no-op on CPU) before reading a clock."""
    if device == "cuda":
        torch.cuda.synchronize()


def result_line(values: dict[str, float]) -> str:
    """``RESULT name=value ...`` with 4 significant digits."""
    return "RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def parse_result(line: str) -> dict[str, float]:
    """The numbers of a ``RESULT name=value ...`` line."""
    if not line.startswith("RESULT "):
        raise ValueError(f"not a RESULT line: {line!r}")
    return {k: float(v) for k, v in (item.split("=", 1) for item in line.split()[1:])}


def bar(ok: bool) -> str:
    """``met`` or ``NOT met``, for the human-readable summary."""
    return "met" if ok else "NOT met"


# ------------------------------------------------------------------------ I/O reference
def io_reference_seconds(hf_dir: str | os.PathLike, out_path: str | os.PathLike, *, fsync: bool) -> float:
    """Read every safetensors file of ``hf_dir`` fully, ``torch.save`` the tensors; seconds.

    With ``fsync`` the written file is flushed to the disk before the clock stops.
    """
    from safetensors.torch import load_file

    start = time.perf_counter()
    tensors = {}
    for path in safetensors_files(hf_dir):
        tensors.update(load_file(path))
    with open(out_path, "wb") as f:
        torch.save(tensors, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    del tensors
    os.remove(out_path)
    return seconds


# ----------------------------------------------------------------------------- ranks
def convert_rank_job(
    hf_dir: str, work: str, repeats: int, bucket_bytes: int, shard_bytes: int, device: str, tp: int, pp: int
) -> dict:
    """On each rank: HF→Megatron (load + save) and Megatron→HF (load + export + write), timed.

    Returns this rank's per-repeat seconds; rank 0 writes the exported checkpoints under
    ``work/export-<k>``.
    """
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.convert import WeightExporter, load_dist_checkpoint, load_hf_into, save_dist_checkpoint
    from megarl.convert.hf_io import ShardedWriter, copy_side_files
    from megarl.models import build_model_chunks, family_for

    hf_config = AutoConfig.from_pretrained(hf_dir)
    groups = init_ranks(device, tp, pp)
    family = family_for(hf_config)
    out = {"to_mcore": [], "to_hf": []}

    chunks = build_model_chunks(family, hf_config, groups.dims)
    for k in range(repeats):
        ckpt = f"{work}/mcore-{k}"
        dist.barrier()
        start = time.perf_counter()
        bytes_read = load_hf_into(chunks, hf_dir, family, groups, hf_config=hf_config)
        synchronize(device)
        loaded = time.perf_counter()
        save_dist_checkpoint(chunks, ckpt)
        done = time.perf_counter()
        out["to_mcore"].append({"load_s": loaded - start, "save_s": done - loaded, "total_s": done - start})
        out["bytes_read"] = bytes_read
    del chunks

    chunks = build_model_chunks(family, hf_config, groups.dims)  # fresh random weights: the load must fill them
    ckpt = f"{work}/mcore-{repeats - 1}"
    for k in range(repeats):
        target = Path(f"{work}/export-{k}")
        if groups.rank == 0:
            target.mkdir(parents=True)
        dist.barrier()
        start = time.perf_counter()
        load_dist_checkpoint(chunks, ckpt)
        synchronize(device)
        loaded = time.perf_counter()
        exporter = WeightExporter(chunks, family, hf_config, groups)
        planned = time.perf_counter()
        writer = ShardedWriter(target, max_shard_bytes=shard_bytes) if groups.rank == 0 else None
        for bucket in exporter.iter_full(bucket_bytes):
            if writer is not None:
                for name, tensor in bucket:
                    writer.add(name, tensor.cpu())
        if writer is not None:
            writer.close()
        done = time.perf_counter()
        if writer is not None:
            copy_side_files(hf_dir, target)  # not timed: config files
        out["to_hf"].append(
            {"load_s": loaded - start, "plan_s": planned - loaded, "export_s": done - planned, "total_s": done - start}
        )
    out["total_bytes"] = exporter.total_bytes
    return out


# ------------------------------------------------------------------------ correctness
def compare_checkpoints(original: str | os.PathLike, exported: str | os.PathLike) -> tuple[bool, str]:
    """(bit-exact with the same names, a one-line description)."""
    from megarl.convert.hf_io import HFCheckpoint
    from megarl.convert.layout import Slice

    a, b = HFCheckpoint(original), HFCheckpoint(exported)
    names_a, names_b = set(a.names()), set(b.names())
    if names_a != names_b:
        return False, f"names differ: only original {sorted(names_a - names_b)[:5]}, only export {sorted(names_b - names_a)[:5]}"
    different = [n for n in sorted(names_a) if not torch.equal(a.read(n, Slice(None)), b.read(n, Slice(None)))]
    if different:
        return False, f"{len(different)} of {len(names_a)} tensors differ, e.g. {different[:5]}"
    return True, f"all {len(names_a)} tensors bit-equal"


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; print a report ending with the RESULT line; return its numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--repeats", type=int, default=2,
                        help="times each conversion and the reference run; the best is kept (default: %(default)s)")
    parser.add_argument("--bucket-mb", type=float, default=64, help="export bucket size in MiB (default: %(default)s)")
    parser.add_argument("--shard-mb", type=int, default=128,
                        help="safetensors shard size in MB, for the input and the export (default: %(default)s)")
    args = parser.parse_args(argv)
    from megarl.parallel.launch import run_ranks

    torch.set_num_threads(1)  # the ranks have one thread each; so has the reference
    world = args.tp * args.pp
    check_device(args.device, world)
    hf_config = make_hf_config(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hf_dir = work / "hf"
        model_bytes = save_random_hf_model(hf_config, hf_dir, shard_mb=args.shard_mb)
        files = safetensors_files(hf_dir)
        print(
            f"model: {args.family} hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
            f"intermediate={hf_config.intermediate_size} heads={hf_config.num_attention_heads}/"
            f"{hf_config.num_key_value_heads} tied={args.tied}: {model_bytes / MB:.1f} MiB fp32 in {len(files)} file(s)"
        )

        io_plain, io_fsync = [], []
        for _ in range(args.repeats):
            io_plain.append(io_reference_seconds(hf_dir, work / "io.pt", fsync=False))
            io_fsync.append(io_reference_seconds(hf_dir, work / "io.pt", fsync=True))
        results = run_ranks(
            convert_rank_job, world, str(hf_dir), str(work), args.repeats, int(args.bucket_mb * MB),
            args.shard_mb * 10**6, args.device, args.tp, args.pp, timeout_s=args.timeout, env=rank_env(args.device),
        )
        io_plain.append(io_reference_seconds(hf_dir, work / "io.pt", fsync=False))  # before and after the ranks
        io_fsync.append(io_reference_seconds(hf_dir, work / "io.pt", fsync=True))
        exact, how = compare_checkpoints(hf_dir, work / f"export-{args.repeats - 1}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    def best(direction: str, key: str = "total_s") -> tuple[float, dict]:
        """The best repeat by the slowest rank's total; that repeat's per-phase maxima."""
        per_repeat = [
            {k: max(r[direction][rep][k] for r in results) for k in results[0][direction][rep]}
            for rep in range(args.repeats)
        ]
        chosen = min(per_repeat, key=lambda p: p[key])
        return chosen[key], chosen

    to_mcore_s, to_mcore = best("to_mcore")
    to_hf_s, to_hf = best("to_hf")
    io_s, io_fsync_s = min(io_plain), min(io_fsync)
    ratio_mcore, ratio_hf = to_mcore_s / io_s, to_hf_s / io_s
    read_mb = sum(r["bytes_read"] for r in results) / MB

    print(f"I/O-only reference (1 process): read + torch.save {io_s:.2f} s; with fsync {io_fsync_s:.2f} s "
          f"(runs: {', '.join(f'{t:.2f}' for t in io_plain)} / {', '.join(f'{t:.2f}' for t in io_fsync)})")
    print(f"HF->Megatron TP={args.tp}xPP={args.pp}: {to_mcore_s:.2f} s (per-phase maxima over ranks: load_hf_into {to_mcore['load_s']:.2f} s, "
          f"save_dist_checkpoint {to_mcore['save_s']:.2f} s; ranks read {read_mb:.1f} MiB in all) "
          f"= {ratio_mcore:.2f}x I/O-only ({to_mcore_s / io_fsync_s:.2f}x the fsync'd reference; "
          f"torch_dist fsyncs its files) -> bar <= 2x {bar(ratio_mcore <= 2)}")
    print(f"Megatron->HF: {to_hf_s:.2f} s (per-phase maxima over ranks: load_dist_checkpoint {to_hf['load_s']:.2f} s, "
          f"plan {to_hf['plan_s']:.2f} s, iter_full + rank-0 write {to_hf['export_s']:.2f} s) "
          f"= {ratio_hf:.2f}x I/O-only -> bar <= 2x {bar(ratio_hf <= 2)}")
    print(f"round trip HF->Megatron->HF: {'bit-exact' if exact else 'NOT bit-exact'} ({how})")
    values = {
        "hf_to_mcore_s": to_mcore_s,
        "mcore_to_hf_s": to_hf_s,
        "io_only_s": io_s,
        "io_only_fsync_s": io_fsync_s,
        "hf_to_mcore_ratio": ratio_mcore,
        "mcore_to_hf_ratio": ratio_hf,
        "hf_to_mcore_ratio_vs_fsync": to_mcore_s / io_fsync_s,
        "model_mb": model_bytes / MB,
        "bit_exact": int(exact),
    }
    print(result_line(values), flush=True)
    return {k: float(v) for k, v in values.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
