"""Vocab-parallel log-prob and entropy at TP=2 equal the full-softmax computation.

The same 2-rank job also checks the CPU model-parallel RNG tracker (dropout streams), and that initialising
one layout after another releases the previous layout's groups.
"""

import pytest
import torch

from megarl.parallel.launch import run_ranks

VOCAB, PADDED = 37, 40  # 3 padded columns on the last shard
TEMPERATURE = 0.6


def _inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, PADDED, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, VOCAB, (3, 5), generator=gen)
    g_logp, g_ent = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    return logits.float(), targets, g_logp, g_ent


def _full_softmax():
    """Reference in float64 over the true vocabulary, with autograd."""
    logits, targets, g_logp, g_ent = _inputs()
    full = logits.double().requires_grad_(True)
    logp_all = torch.log_softmax(full[..., :VOCAB] / TEMPERATURE, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp * g_logp + entropy * g_ent).sum().backward()
    return logp.detach(), entropy.detach(), full.grad


def logprob_job():
    import torch.distributed as dist

    from megarl.parallel import ParallelDims, init_parallel, vocab_parallel_logprobs

    groups = init_parallel(ParallelDims(tp=2))
    logits, targets, g_logp, g_ent = _inputs()
    shard = logits.chunk(2, dim=-1)[groups.tp_rank].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(shard, targets, TEMPERATURE, tp_group=groups.tp, vocab_size=VOCAB)
    (logp * g_logp + entropy * g_ent).sum().backward()
    grads = [torch.empty_like(shard.grad) for _ in range(2)]
    dist.all_gather(grads, shard.grad, group=groups.tp)
    return logp.detach(), entropy.detach(), torch.cat(grads, dim=-1), _rng_streams(groups), _layouts_in_turn()


def _layouts_in_turn(cycles: int = 4):
    """This rank's thread count after each of ``cycles`` layouts initialised in turn (DP=2, TP=2, DP=2, TP=2: each
    destroys the one before), and a sum over the last layout's TP group."""
    import os

    import torch.distributed as dist

    from megarl.parallel import ParallelDims, init_parallel

    threads = []
    for cycle in range(cycles):
        groups = init_parallel(ParallelDims(tp=2) if cycle % 2 else ParallelDims(tp=1))
        threads.append(len(os.listdir("/proc/self/task")))
    total = torch.ones(1)
    dist.all_reduce(total, group=groups.tp)
    return threads, float(total)


def _rng_streams(groups):
    """Draws from the default stream and from the tensor-parallel stream, twice from one seed."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megarl.parallel import set_seed

    draws = []
    for _ in range(2):
        set_seed(5, groups)
        default = torch.rand(4)
        with get_cuda_rng_tracker().fork():
            tp_stream = torch.rand(4)
        draws.append((default, tp_stream, torch.rand(4)))
    return draws


@pytest.fixture(scope="module")
def tp2_results():
    return run_ranks(logprob_job, 2, timeout_s=120)


def test_tp2_logprob_entropy_and_grad_equal_full_softmax(tp2_results):
    ref_logp, ref_entropy, ref_grad = _full_softmax()
    for logp, entropy, grad, *_ in tp2_results:
        assert (logp.double() - ref_logp).abs().max() <= 1e-6
        assert (entropy.double() - ref_entropy).abs().max() <= 1e-6
        assert (grad.double() - ref_grad).abs().max() <= 1e-6
        assert grad[..., VOCAB:].abs().max() == 0  # padded columns get no gradient


def test_single_shard_matches_full_softmax():
    from megarl.parallel import vocab_parallel_logprobs

    logits, targets, g_logp, g_ent = _inputs()
    shard = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(shard, targets, TEMPERATURE, vocab_size=VOCAB)
    (logp * g_logp + entropy * g_ent).sum().backward()
    ref_logp, ref_entropy, ref_grad = _full_softmax()
    assert (logp.double() - ref_logp).abs().max() <= 1e-6
    assert (entropy.double() - ref_entropy).abs().max() <= 1e-6
    assert (shard.grad.double() - ref_grad).abs().max() <= 1e-6


def test_hand_computed_two_token_vocabulary():
    from megarl.parallel import vocab_parallel_logprobs

    # logits [0, ln 3] at T=1: p = [1/4, 3/4]; log p(1) = ln 0.75; H = -(.25 ln .25 + .75 ln .75)
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]])
    logp, entropy = vocab_parallel_logprobs(logits, torch.tensor([1]))
    assert logp.item() == pytest.approx(-0.2876820724517809, abs=1e-7)
    assert entropy.item() == pytest.approx(0.5623351446188083, abs=1e-7)


def test_rejects_bad_inputs():
    from megarl.parallel import vocab_parallel_logprobs

    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="target_ids shape"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))


def test_cpu_rng_tracker_gives_per_tp_rank_streams(tp2_results):
    (first0, again0), (first1, _) = (r[3] for r in tp2_results)
    # Same seed, same draws: reproducible.
    for a, b in zip(first0, again0):
        assert torch.equal(a, b)
    # Default stream is shared by the TP ranks; the model-parallel stream differs per rank.
    assert torch.equal(first0[0], first1[0])
    assert not torch.equal(first0[1], first1[1])
    # Forking leaves the default stream where it was.
    assert torch.equal(first0[2], first1[2]) and not torch.equal(first0[0], first0[2])


def test_a_new_layout_releases_the_groups_of_the_one_before(tp2_results):
    """Megatron's own tear-down keeps most of its groups (on gloo, each with threads and connections): a process
    that initialised a few layouts held some 1,000 threads per rank."""
    for *_, (threads, total) in tp2_results:
        assert threads[2] <= threads[0] + 4 and threads[3] <= threads[1] + 4, threads  # the same layout: no more
        assert total == 2.0  # the last layout's TP group works
