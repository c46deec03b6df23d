"""Benchmark: megarl's per-token log-probs and entropy against torch's log-softmax, forward and backward.

What every training step computes on the ``[T, V]`` logits (``megarl.parallel.logprob.vocab_parallel_logprobs``:
chunks of rows, the padded vocabulary left out, the log-prob of each target and the entropy, in fp32 from bf16
logits), against the plain computation HF transformers' own training does, also in fp32
(``log_softmax(logits.float())`` gathered at the targets, the entropy from it). Both with the PPO loss's usual
gradient (log-probs only) and with an entropy term. The logits are random bf16 at ``--tokens`` × ``--vocab``;
the best of ``--repeats`` runs of each is kept, the two interleaved. Runs on CUDA when there is one, else on the
CPU (``OMP_NUM_THREADS`` threads).

``speedup`` = torch's seconds over megarl's (forward and backward); ``peak_frac`` = megarl's peak memory of
temporaries over torch's (CUDA only). One line:
``RESULT logprob_speedup=<x> logprob_entropy_speedup=<x> megarl_s=<x> torch_s=<x> [peak_frac=<x>]``.

    python tools/bench_logprob.py                           # 2048 tokens, a 32 768-token vocabulary
    python tools/bench_logprob.py --tokens 8192 --vocab 151936
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_convert as common
import torch

from megarl.parallel.logprob import vocab_parallel_logprobs


def _torch(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _megarl(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return vocab_parallel_logprobs(logits, targets)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(function, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, entropy: bool) -> float:
    x = logits.detach().requires_grad_(True)
    _sync(x.device)
    start = time.perf_counter()
    logp, ent = function(x, targets)
    ((logp * weights + ent * weights.flip(0)) if entropy else logp * weights).sum().backward()
    _sync(x.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=generator, device=device) * 3).bfloat16()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator, device=device)
    weights = torch.linspace(-1, 1, args.tokens, device=device)
    # the same numbers first (a benchmark of a wrong function would say nothing)
    (ours, ours_h), (ref, ref_h) = _megarl(logits, targets), _torch(logits, targets)
    assert (ours - ref).abs().max() <= 1e-4 and (ours_h - ref_h).abs().max() <= 1e-3, "log-probs differ"
    best = {}
    peaks = {}
    for entropy in (False, True):
        for _ in range(args.repeats):
            for name, function in (("megarl", _megarl), ("torch", _torch)):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                seconds = _time(function, logits, targets, weights, entropy)
                key = (name, entropy)
                best[key] = min(best.get(key, float("inf")), seconds)
                if device.type == "cuda":
                    peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated(device) - base)
    values = {"logprob_speedup": best["torch", False] / best["megarl", False],
              "logprob_entropy_speedup": best["torch", True] / best["megarl", True],
              "megarl_s": best["megarl", False], "torch_s": best["torch", False]}
    if peaks:
        values["peak_frac"] = peaks["megarl"] / peaks["torch"]
    print(f"{device.type}: {args.tokens} tokens x {args.vocab} vocabulary, bf16 logits, best of {args.repeats}")
    print(common.result_line(values), flush=True)


if __name__ == "__main__":
    main()
