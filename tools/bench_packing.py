"""Benchmark: forward + backward of one batch padded against packed (THD), on one CPU rank.

The workload: a batch of ``--rows`` sequences of seeded lengths uniform in ``--min-len``..``--max-len`` (16-512
by default), through :func:`megarl.parallel.forward_backward` once padded to the longest row
(``packed=False``) and once packed end to end (``packed=True``: megarl's per-segment attention), on a random
model (``--layers`` ≥ 4, ``--hidden`` 256). Both see the same rows and loss (the mean log-prob of the real
next tokens); the log-probs of the two are checked equal (≤ 1e-5) before timing. Each is timed ``--repeats``
times after one warm-up; the median is kept.

    python tools/bench_packing.py                   # defaults: 16 rows, 16-512 tokens, 4 layers, hidden 256

The last line is ``RESULT packed_speedup=<padded_s / packed_s> padded_s=<x> packed_s=<x> max_logp_diff=<x>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench_convert holds shared helpers

import bench_convert as common
import torch

import megarl.parallel  # noqa: F401  (before Megatron: silences its CPU fallback warnings in ranks)


def make_batch(rows: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` right-padded sequences of seeded lengths in ``min_len..max_len``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (rows,), generator=generator)
    width = int(lengths.max())
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (rows, width), generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask}


def packing_job(hf_config, batch: dict, repeats: int) -> dict:
    """On one rank: the two layouts' log-probs compared, then each forward + backward timed."""
    from megarl.models import build_model_chunks, family_for
    from megarl.parallel import ParallelDims, forward_backward, init_parallel

    groups = init_parallel(ParallelDims())
    chunks = build_model_chunks(family_for(hf_config), hf_config, groups.dims)
    mask = batch["attention_mask"]
    scored = torch.zeros_like(mask, dtype=torch.float32)
    scored[:, :-1] = (mask[:, :-1] * mask[:, 1:]).float()  # positions whose next token is real

    def loss_fn(logp_BS, entropy_BS, micro_batch):
        return -(logp_BS * scored).sum() / scored.sum(), {}

    def run(packed: bool, forward_only: bool):
        kwargs = {"forward_only": True} if forward_only else {"loss_fn": loss_fn}
        return forward_backward(chunks, [batch], groups=groups, packed=packed, **kwargs)

    with torch.no_grad():
        logp = {packed: run(packed, True)[0]["logp"] for packed in (False, True)}
    diff = float(((logp[False] - logp[True]) * scored).abs().max())
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(repeats + 1):
        for packed in (False, True):
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            start = time.perf_counter()
            run(packed, False)
            if round_ > 0:  # the first round warms up
                seconds[packed].append(time.perf_counter() - start)
    return {"padded_s": statistics.median(seconds[False]), "packed_s": statistics.median(seconds[True]),
            "max_logp_diff": diff, "tokens": int(mask.sum()), "padded_tokens": int(mask.numel())}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the benchmark; print a report ending with the RESULT line; return its numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_arguments(parser, hidden=256, layers=4, vocab=1024)
    parser.set_defaults(tp=1, pp=1)
    parser.add_argument("--rows", type=int, default=16, help="sequences in the batch (default: %(default)s)")
    parser.add_argument("--min-len", type=int, default=16, help="shortest sequence (default: %(default)s)")
    parser.add_argument("--max-len", type=int, default=512, help="longest sequence (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, after a warm-up; the median "
                                                                "is kept (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.device != "cpu" or args.tp != 1 or args.pp != 1:
        raise SystemExit("bench_packing runs on one CPU rank: --device cpu --tp 1 --pp 1")
    from megarl.parallel.launch import run_ranks

    hf_config = common.make_hf_config(args)
    batch = make_batch(args.rows, args.min_len, args.max_len, args.vocab)
    print(f"model: {args.family} hidden={args.hidden} layers={args.layers} vocab={args.vocab}; {args.rows} rows of "
          f"{args.min_len}-{args.max_len} tokens", flush=True)
    (out,) = run_ranks(packing_job, 1, hf_config, batch, args.repeats, timeout_s=args.timeout,
                       env=common.rank_env("cpu"))
    values = {"packed_speedup": out["padded_s"] / out["packed_s"], "padded_s": out["padded_s"],
              "packed_s": out["packed_s"], "max_logp_diff": out["max_logp_diff"]}
    print(f"padded: {out['padded_tokens']} token positions, {out['padded_s']:.3f} s; packed: {out['tokens']} tokens, "
          f"{out['packed_s']:.3f} s -> {values['packed_speedup']:.2f}x "
          f"(bar >= 1.8x {common.bar(values['packed_speedup'] >= 1.8)}); log-probs equal to "
          f"{out['max_logp_diff']:.1e} ({common.bar(out['max_logp_diff'] <= 1e-5)})")
    print(common.result_line(values), flush=True)
    return values


if __name__ == "__main__":
    main(sys.argv[1:])
