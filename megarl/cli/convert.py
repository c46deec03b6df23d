"""``megarl-convert``: checkpoints between Hugging Face layout and Megatron at any TP/PP.

  megarl-convert hf-to-mcore --hf DIR --out DIR --tp N --pp M [--vpp K] [--first-stage-layers F]
      [--last-stage-layers L] [--ep E] [--etp T] [--dtype bf16|fp32]
  megarl-convert mcore-to-hf --mcore DIR --out DIR [--hf-config DIR] [--dtype ...]
  megarl-convert hf-to-fp8 --hf DIR --out DIR   (linear weights as block FP8, for FP8 rollout engines)

``--mcore`` is an hf-to-mcore output, or a training checkpoint: a run's ``global_step_<k>/actor``, its
``global_step_<k>`` directory, or the run's checkpoint root (its latest committed checkpoint); the
layout and dtype it was saved at come from its metadata, the HF config and tokenizer from the
checkpoint itself (``--hf-config`` for checkpoints saved before checkpoints kept them).

On CPU it spawns its own gloo ranks (tp × pp of them); on GPU it uses NCCL, one GPU per rank.
Before any rank starts, it refuses (exit code 2, one line naming the flag and the file) an
--out that is a file, not writable or not empty without --force; a truncated or corrupt input
file (safetensors headers, Megatron shards against their metadata); and an --hf-config whose
tensor shapes differ from the checkpoint's. A rank that fails exits 1; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys

from megarl.convert import jobs


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    for suffix, factor in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def mcore_source(path: str) -> jobs.McoreSource:
    """What ``--mcore`` names: an hf-to-mcore output, a training checkpoint's role directory (``actor/``), its
    step directory (its ``actor/``) or a run's checkpoint root (its latest committed checkpoint's ``actor/``)."""
    from megarl.controller.run_checkpoints import role_checkpoint
    from megarl.workers.model_checkpoint import DIST_DIR, METADATA_FILE, export_source

    try:
        directory = role_checkpoint(path, "actor")
        if (directory / "megarl.json").exists():
            return jobs.read_mcore_source(directory)
        if (directory / METADATA_FILE).exists() or (directory / DIST_DIR).is_dir():
            return export_source(directory)
    except ValueError as error:
        raise ValueError(f"--mcore {error}") from None
    raise ValueError(
        f"--mcore {path} is not a megarl Megatron checkpoint: pass an hf-to-mcore output (megarl.json and model/), "
        f"a training checkpoint's actor/ ({METADATA_FILE} and {DIST_DIR}/), its global_step_<k>/ directory or the "
        "run's checkpoint root (latest_checkpointed_iteration.txt)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="megarl-convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    to_mcore = commands.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True, help="output directory for the Megatron checkpoint")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the saved layout")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the saved layout")
    to_mcore.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per pipeline rank")
    to_mcore.add_argument("--first-stage-layers", type=int, default=None,
                          help="layers of the first pipeline stage where they do not split evenly (e.g. 61 layers)")
    to_mcore.add_argument("--last-stage-layers", type=int, default=None,
                          help="layers of the last pipeline stage where they do not split evenly")
    to_mcore.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    to_mcore.add_argument("--etp", type=int, default=None, help="expert-tensor-parallel size (default: --tp)")
    to_mcore.add_argument("--dtype", choices=sorted(jobs.DTYPES), default="fp32", help="parameter dtype")

    to_hf = commands.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF safetensors")
    to_hf.add_argument("--mcore", required=True,
                       help="Megatron checkpoint written by megarl: an hf-to-mcore output, or a training checkpoint "
                            "(global_step_<k>/actor, global_step_<k>, or the run's checkpoint root for its latest)")
    to_hf.add_argument("--out", required=True, help="output directory for the HF checkpoint")
    to_hf.add_argument("--hf-config", default=None,
                       help="HF config/tokenizer directory (default: the checkpoint's own; needed for training "
                            "checkpoints saved before they kept one)")
    to_hf.add_argument("--tp", type=int, default=None, help="layout to load with (default: as saved)")
    to_hf.add_argument("--pp", type=int, default=None, help="layout to load with (default: as saved)")
    to_hf.add_argument("--ep", type=int, default=None, help="expert layout to load with (default: as saved)")
    to_hf.add_argument("--etp", type=int, default=None, help="expert-tensor layout to load with (default: as saved)")
    to_hf.add_argument("--dtype", choices=sorted(jobs.DTYPES), default=None, help="dtype of the HF tensors (default: as saved)")
    to_hf.add_argument("--max-shard-size", type=_size, default="5GB", help="largest safetensors shard (e.g. 500MB)")
    to_hf.add_argument("--peft", action="store_true",
                       help="a LoRA run's checkpoint: write its adapters alone in PEFT's format (adapter_config.json, "
                            "adapter_model.safetensors) instead of the merged model")
    to_hf.add_argument("--base", default=None,
                       help="a LoRA run's checkpoint: the HF directory of its base model (default: the one its run "
                            "loaded, recorded in the checkpoint)")

    to_fp8 = commands.add_parser("hf-to-fp8", help="HF safetensors -> block-FP8 HF safetensors (FP8 rollout)")
    to_fp8.add_argument("--hf", required=True, help="HF model directory in its training dtype")
    to_fp8.add_argument("--out", required=True, help="output directory for the FP8 checkpoint")
    to_fp8.add_argument("--max-shard-size", type=_size, default="5GB", help="largest safetensors shard (e.g. 500MB)")

    for sub in (to_mcore, to_hf, to_fp8):
        sub.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    for sub in (to_mcore, to_hf):
        sub.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one conversion; exit code 0 on success, 2 on a usage or input error, 1 on a rank failure."""
    from megarl.parallel.launch import RankFailure

    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if args.command == "hf-to-fp8":
            report = jobs.hf_to_fp8(args.hf, args.out, max_shard_bytes=args.max_shard_size, force=args.force)
        elif args.command == "hf-to-mcore":
            report = jobs.hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                                      etp=args.etp, first_stage_layers=args.first_stage_layers,
                                      last_stage_layers=args.last_stage_layers, dtype=args.dtype, force=args.force,
                                      timeout_s=args.timeout)
        else:
            source = mcore_source(args.mcore)
            if str(source.directory) != args.mcore:
                print(f"megarl-convert: --mcore {args.mcore} is the checkpoint {source.directory}", flush=True)
            report = jobs.mcore_to_hf(source, args.out, hf_config_dir=args.hf_config, tp=args.tp, pp=args.pp,
                                      ep=args.ep, etp=args.etp, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                                      force=args.force, timeout_s=args.timeout, peft=args.peft, base_dir=args.base)
    except ValueError as error:
        parser.exit(2, f"megarl-convert: error: {error}\n")
    except RankFailure as error:
        parser.exit(1, f"megarl-convert: a rank failed; nothing was written to --out.\n{error}\n")
    if report.skipped_line():
        print(f"megarl-convert: {report.skipped_line()}")
    print(
        f"megarl-convert: wrote {report.output} ({report.num_tensors} tensors, {report.num_bytes / 2**20:.1f} MiB) "
        f"in {report.seconds:.1f} s on {report.num_ranks} rank(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
