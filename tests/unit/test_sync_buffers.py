"""What a weight sync allocates, as each transport reports it (megarl.sync.base.WeightTransport.plan_buffers, which
megarl-plan prints): the buckets, the ring of buffers they take turns in, the ranks that hold them, and the
exporter's own rule for it (megarl.convert.param_map.rank_buckets, which WeightExporter.iter_buckets calls)."""

from __future__ import annotations

import pytest

from megarl.convert.param_map import Unit, rank_buckets, ring_lengths, stripe_numel
from megarl.models.weights import Split, WeightRule
from megarl.sync import RankLayout, transport_class
from megarl.sync.distributed import DistributedTransport
from megarl.sync.tensor import NUM_BUFFERS, TensorTransport

ELEMENT = 2  # bytes per element (bf16)


RULE = WeightRule("t", ("t",), Split.REPLICATED)
"""Any one tensor's rule (the buckets read only its co-load key: none)."""


def unit(numel: int, stage: int, ep_owner: int | None = None) -> Unit:
    return Unit(RULE, None, stage, 0, (f"t{numel}",), ((numel,),), expert=ep_owner, ep_owner=ep_owner)


def nbytes(u: Unit) -> int:
    return u.hf_shapes[0][0] * ELEMENT


def layouts(tp: int, pp: int, ep_groups: dict[int, tuple[int, ...]] | None = None) -> dict[int, RankLayout]:
    """Ranks of a TP x PP actor (dp = 1), TP fastest."""
    return {r: RankLayout(r // tp, r % tp, tuple(r % tp + p * tp for p in range(pp)),
                          (ep_groups or {}).get(r, (r % tp,))) for r in range(tp * pp)}


# Stage 0: buckets of 5, 7 (a tensor larger than a bucket, alone) and 3 elements; stage 1: 4 and 6.
UNITS = [unit(2, 0), unit(3, 0), unit(7, 0), unit(3, 0), unit(4, 1), unit(6, 1)]


def test_the_transports_classes_say_what_they_ask_of_the_export():
    assert transport_class("tensor") is TensorTransport and transport_class("distributed") is DistributedTransport
    assert TensorTransport.num_buffers == NUM_BUFFERS == 2 and DistributedTransport.num_buffers == 1
    assert TensorTransport.bucket_budget(512 << 20) == 256 << 20  # rollout.bucket_mb over the two buffers
    assert DistributedTransport.bucket_budget(512 << 20) == 512 << 20
    assert (TensorTransport.holding_tp_ranks, DistributedTransport.holding_tp_ranks) == (None, (0,))
    assert TensorTransport.receiving_stages((0, 4, 8), hosts={4, 8}) == (1, 2)
    assert DistributedTransport.receiving_stages((0, 4, 8), hosts={4, 8}) == ()
    with pytest.raises(ValueError, match="unknown weight transport"):
        transport_class("nccl")


def test_tensor_every_rank_holds_every_bucket_on_stages_hosting_engines_in_two_buffers():
    """Buckets of at most 5 elements (bucket_bytes 20 over two buffers), each buffer as large as the largest bucket it
    takes (padded to tp = 2 stripes); a stage hosting engine ranks holds every stage's buckets."""
    out = TensorTransport.plan_buffers(UNITS, nbytes, bucket_bytes=20, element_size=ELEMENT, tp=2,
                                       ranks=layouts(2, 2), hosts={0, 1, 2, 3})
    assert (out.bucket_bytes, out.num_buffers, out.buckets) == (10, 2, 5)
    assert out.sizes == tuple(n * ELEMENT for n in (5, 7, 3, 4, 6)) and out.owners == (0, 0, 0, 1, 1)
    assert out.padded == tuple(n * ELEMENT for n in (6, 8, 4, 4, 6))
    # buckets 0, 2, 4 in the first buffer (6, 4, 6), 1, 3 in the second (8, 4)
    assert out.actor == {r: (6 + 8) * ELEMENT for r in range(4)} and out.engine == 0
    # Engines on stage 0 only: stage 1 holds only its own buckets (4 in one buffer, 6 in the other).
    stage_0 = TensorTransport.plan_buffers(UNITS, nbytes, bucket_bytes=20, element_size=ELEMENT, tp=2,
                                           ranks=layouts(2, 2), hosts={0, 1})
    assert stage_0.actor == {0: 14 * ELEMENT, 1: 14 * ELEMENT, 2: 10 * ELEMENT, 3: 10 * ELEMENT}


def test_distributed_tp_0_ranks_hold_their_stage_s_buckets_and_engines_receive_each():
    out = DistributedTransport.plan_buffers(UNITS, nbytes, bucket_bytes=20, element_size=ELEMENT, tp=2,
                                            ranks=layouts(2, 2), hosts={0, 1, 2, 3})
    assert (out.bucket_bytes, out.num_buffers) == (20, 1)
    assert out.sizes == tuple(n * ELEMENT for n in (5, 10, 10))  # buckets of at most 10 elements
    # One buffer as large as the stage's largest bucket, on the TP-0 ranks; nothing on the others.
    assert out.actor == {0: 10 * ELEMENT, 1: 0, 2: 10 * ELEMENT, 3: 0}
    assert out.engine == 10 * ELEMENT  # the largest bucket
    odd = DistributedTransport.plan_buffers([unit(7, 0)], nbytes, bucket_bytes=20, element_size=ELEMENT, tp=2,
                                            ranks=layouts(2, 1))
    assert (odd.actor, odd.engine) == ({0: 8 * ELEMENT, 1: 0}, 7 * ELEMENT)  # the buffer padded to tp, not the bucket


def test_a_rank_without_buckets_passes_its_stage_s_expert_buckets_on_in_a_scratch():
    """distributed under expert parallelism: a TP-1 rank whose EP group has a TP-0 member fills (or receives) the
    stage's expert buckets for it, in a scratch of each bucket's size."""
    units = [unit(4, 0), unit(6, 0, ep_owner=0), unit(9, 0, ep_owner=1)]
    ranks = layouts(2, 1, ep_groups={0: (0, 1), 1: (0, 1)})
    out = DistributedTransport.plan_buffers(units, nbytes, bucket_bytes=100, element_size=ELEMENT, tp=2, ranks=ranks)
    assert out.buckets == 3  # experts of another EP rank never share a bucket
    assert out.actor == {0: 10 * ELEMENT, 1: 9 * ELEMENT}
    alone = layouts(2, 1, ep_groups={0: (0,), 1: (1,)})  # no TP-0 member in rank 1's EP group: nothing to pass on
    assert DistributedTransport.plan_buffers(units, nbytes, bucket_bytes=100, element_size=ELEMENT, tp=2,
                                             ranks=alone).actor[1] == 0


def test_the_exporter_s_rule():
    assert stripe_numel(7, 4) == 8 and stripe_numel(8, 4) == 8
    assert ring_lengths([6, 8, 4, 4, 6], 2) == [6, 8] and ring_lengths([3, 5], 0) == [3, 5]
    held = rank_buckets([5, 7, 3], [0, 1, 1], [False, False, False], stage=0, tp=1, tp_rank=0, num_buffers=1,
                        to_pp_ranks=None, tp_ranks=None, ep_tp_ranks=(0,))
    assert held.held == (0, 1, 2) and held.ring == (7,) and held.numel == 7
