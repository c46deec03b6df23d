"""Vocabulary-parallel log-probs in chunks of rows: the same numbers, and no fp32 copy of all the logits.

(Across TP ranks: tests/distributed/test_logprob.py.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.parallel import logprob

T, V = 24, 50


class _Allocations(TorchDispatchMode):
    """The element count of every tensor an operation allocates (views and in-place results are no allocation)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = any(r.alias_info is not None for r in func._schema.returns)  # a view, or in place / out=
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not aliases:
                self.sizes.append(t.numel())
        return out


def _run(chunk_elements: int, monkeypatch, *, dtype=torch.float32, record: bool = False, entropy_loss: bool = True):
    monkeypatch.setattr(logprob, "CHUNK_ELEMENTS", chunk_elements, raising=False)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, T // 2, V, generator=generator) * 4).to(dtype).requires_grad_(True)
    targets = torch.randint(0, V - 6, (2, T // 2), generator=generator)
    forward, backward = _Allocations(), _Allocations()
    with forward if record else contextlib.nullcontext():
        logp, entropy = logprob.vocab_parallel_logprobs(logits, targets, 0.7, vocab_size=V - 6)  # 6 padded columns
    weights = torch.linspace(-1, 1, T // 2)
    with backward if record else contextlib.nullcontext():
        ((logp * weights + entropy * weights.flip(0)) if entropy_loss else logp * weights).sum().backward()
    return (logp, entropy, logits.grad), forward.sizes, backward.sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_rows_give_the_numbers_of_the_whole(monkeypatch, dtype):
    whole, _, _ = _run(1 << 24, monkeypatch, dtype=dtype)
    for rows in (1, 5, 7):
        chunked, _, _ = _run(rows * V, monkeypatch, dtype=dtype)
        assert all(torch.equal(a, b) for a, b in zip(whole, chunked)), rows
    logp, entropy, grad = whole
    assert logp.dtype == entropy.dtype == torch.float32 and grad.dtype == dtype
    assert bool((logp < 0).all()) and bool((entropy > 0).all())


def test_no_operation_allocates_more_than_a_chunk_of_logits_besides_the_gradient(monkeypatch):
    """With 5 rows per chunk: the forward's and the backward's temporaries hold at most 5 × V elements; the only
    ``[T, V]`` allocation is the logits' gradient (which autograd needs whole)."""
    _, forward, backward = _run(5 * V, monkeypatch, record=True)
    assert max(forward) <= 5 * V
    assert sorted(backward)[-1] == T * V and sorted(backward)[-2] <= 5 * V


@pytest.mark.parametrize("entropy_loss", [False, True])
def test_chunk_temporaries_per_chunk(monkeypatch, entropy_loss):
    """The passes over the logits, counted by their chunk-sized temporaries (the padded columns left out): the
    forward makes two per chunk (``z``, ``exp(z)``), the backward one (the probabilities, turned into the
    gradient in place), two with an entropy term in the loss."""
    _, forward, backward = _run(5 * V, monkeypatch, dtype=torch.bfloat16, record=True, entropy_loss=entropy_loss)
    chunks = -(-T // 5)

    def count(sizes):
        return sum(size >= 4 * (V - 6) for size in sizes if size != T * V)

    assert count(forward) == 2 * chunks
    assert count(backward) == (2 if entropy_loss else 1) * chunks
