"""Benchmark: a LoRA run's weight sync in its two modes (``rollout.lora_sync``), on the real path.

A TP=2 actor on 2 gloo ranks (``--tp``, ``--pp``) with rank-``--rank`` adapters on every linear layer (random ``B``:
they change the model) syncs into one of megarl's CPU engine servers colocated with it (``--tp-size`` = the actor's
TP, LoRA served: ``--enable-lora``), in both modes, interleaved over ``--repeats`` rounds (the best of each kept;
the slowest rank's time, barrier to barrier):

- ``merged``: the base plus ``alpha / rank · B A``, every HF tensor, through the ``tensor`` transport (handles to
  the ranks' shared-memory bucket buffers);
- ``adapters``: the adapters alone in PEFT's layout through ``/load_lora_adapter_from_tensors`` (every tensor's
  checksum checked by every engine rank).

``bytes_frac``: the bytes an ``adapters`` sync delivers over a ``merged`` one's (the issue's bar: <= 5 %);
``speedup``: merged seconds over adapters seconds. Both syncs are checked: the merged one reads back a sample of
eight tensors, the adapters one checks every checksum. One line:
``RESULT adapters_bytes_frac=<x> speedup=<x> merged_s=<x> adapters_s=<x> adapters_mib=<x> merged_mib=<x>``.

    python tools/bench_lora_sync.py                    # defaults: hidden 1024, 8 layers, rank 16 (~470 MiB fp32)
    python tools/bench_lora_sync.py --rank 64 --hidden 2048
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_convert holds shared helpers

import bench_convert as common
import torch

import megarl.parallel  # noqa: F401  (before Megatron: silences its CPU fallback warnings in ranks)

MB = common.MB
MODES = ("merged", "adapters")


def sync_rank_job(hf_dir: str, engine: dict, rank: int, alpha: float, repeats: int, tp: int, pp: int) -> dict:
    """Both modes' syncs from this rank (module docstring); the ranks' statistics and times."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.config.lora import LoraSpec
    from megarl.convert import WeightExporter, load_hf_into
    from megarl.convert.lora import attach_lora
    from megarl.engines.client import EngineAddress
    from megarl.models import build_model_chunks, family_for
    from megarl.sync import make_transport, verify_sample

    hf_config = AutoConfig.from_pretrained(hf_dir)
    groups = common.init_ranks("cpu", tp, pp)
    family = family_for(hf_config)
    chunks = build_model_chunks(family, hf_config, groups.dims, use_te=False)
    load_hf_into(chunks, hf_dir, family, groups, hf_config=hf_config)
    spec = LoraSpec(rank=rank, alpha=alpha, init_b="random")
    attach_lora(chunks, spec, family, hf_config)
    exporter = WeightExporter(chunks, family, hf_config, groups, dtype=torch.float32)
    names = verify_sample([n for u in exporter.units for n in u.hf_names], 8, 0)
    target = EngineAddress(**engine)
    transports = {"merged": make_transport("tensor", groups, [target], device="cpu"),
                  "adapters": make_transport("adapters", groups, [target], device="cpu",
                                             lora_config=spec.peft_config(hf_dir))}
    out: dict = {"rank": dist.get_rank(), "seconds": {m: [] for m in MODES}, "stats": {}}
    for mode, transport in transports.items():  # checked once each
        out["stats"][mode] = transport.sync(exporter, bucket_bytes=64 * MB, version=f"check-{mode}",
                                            verify_names=names if mode == "merged" else ())
    for round_ in range(repeats):
        for mode, transport in transports.items():
            dist.barrier()
            start = time.perf_counter()
            transport.sync(exporter, bucket_bytes=64 * MB, version=f"{mode}{round_}")
            dist.barrier()
            out["seconds"][mode].append(time.perf_counter() - start)
    for transport in transports.values():
        transport.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; print a report ending with its RESULT line; return its numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_arguments(parser, hidden=1024, layers=8, vocab=8192)
    parser.set_defaults(pp=1)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    parser.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds, the modes interleaved; the best of each is kept (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("bench_lora_sync runs the CPU engine server: --device cpu")
    from megarl.config.lora import LoraSpec
    from megarl.engines.server_process import ServerProcess, free_port
    from megarl.models.tiny import build_tiny_tokenizer
    from megarl.parallel.launch import run_ranks
    from megarl.plan.engine_gpus import lora_flags

    torch.set_num_threads(1)
    world, tp, pp = args.tp * args.pp, args.tp, args.pp
    hf_config = common.make_hf_config(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        hf_dir = work / "hf"
        model_bytes = common.save_random_hf_model(hf_config, hf_dir, shard_mb=10**6)
        build_tiny_tokenizer(min(512, args.vocab)).save_pretrained(hf_dir)
        print(f"model: {args.family} hidden={args.hidden} layers={args.layers} vocab={args.vocab}: "
              f"{model_bytes / MB:.1f} MiB fp32; LoRA rank {args.rank} on every linear layer; actor TP={tp}xPP={pp} "
              f"on {world} gloo ranks; one colocated CPU engine server at TP={tp}", flush=True)
        port = free_port()
        flags = lora_flags(LoraSpec(rank=args.rank, alpha=args.alpha))
        server = ServerProcess([sys.executable, "-m", "megarl.engines.cpu_engine", "--model-path", str(hf_dir),
                                "--port", str(port), "--dtype", "float32", "--tp-size", str(tp), *flags],
                               name="engine 0", url=f"http://127.0.0.1:{port}", log_path=work / "engine.log",
                               env={"OMP_NUM_THREADS": "1"}).start()
        server.wait_healthy(300)
        engine = {"index": 0, "url": server.url, "tp": tp, "host_ranks": tuple(range(tp))}
        results = run_ranks(sync_rank_job, world, str(hf_dir), engine, args.rank, args.alpha, args.repeats, tp, pp,
                            timeout_s=args.timeout, env=common.rank_env("cpu"))
    finally:
        if server is not None:
            server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return report(results)


def report(results: list[dict]) -> dict[str, float]:
    """Print the human-readable report and the RESULT line."""
    seconds = {m: min(max(r["seconds"][m][i] for r in results) for i in range(len(results[0]["seconds"][m])))
               for m in MODES}
    sent = {m: sum(r["stats"][m]["weight_sync/bytes"] for r in results if r["stats"][m]) for m in MODES}
    checked = {m: sum(r["stats"][m]["verified_checks"] for r in results if r["stats"][m]) for m in MODES}
    values = {"adapters_bytes_frac": sent["adapters"] / sent["merged"], "speedup": seconds["merged"] /
              seconds["adapters"], "merged_s": seconds["merged"], "adapters_s": seconds["adapters"],
              "adapters_mib": sent["adapters"] / MB, "merged_mib": sent["merged"] / MB}
    for mode in MODES:
        print(f"{mode:>8}: {sent[mode] / MB:9.2f} MiB in {seconds[mode]:.3f} s (best of the rounds), "
              f"{checked[mode]} tensors checked")
    print(f"adapters move {100 * values['adapters_bytes_frac']:.2f} % of merged's bytes (bar: <= 5 %: "
          f"{common.bar(values['adapters_bytes_frac'] <= 0.05)}), {values['speedup']:.1f}x faster")
    print(common.result_line(values), flush=True)
    return values


if __name__ == "__main__":
    main()
