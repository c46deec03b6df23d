"""Packed (THD) and padded model inputs, the zigzag context-parallel split, and the way back (megarl.parallel.packing)."""

from __future__ import annotations

import pytest
import torch

from megarl.parallel.packing import (
    pack_alignment,
    packed_length,
    prepare_packed,
    prepare_padded,
    round_up,
    zigzag_index,
)

# Left-padded prompts, right-padded responses; one row fills the width, one is empty.
IDS = torch.tensor([[0, 0, 11, 12, 13, 14, 0, 0, 0],
                    [21, 22, 23, 24, 25, 26, 27, 28, 29],
                    [0, 0, 0, 0, 0, 0, 0, 0, 0],
                    [0, 31, 32, 33, 0, 0, 0, 0, 0]])
MASK = (IDS != 0).long()


class _Group:
    """What Megatron's get_pg_size / get_pg_rank read from a process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_zigzag_is_megatrons_split_of_one_sequence(monkeypatch):
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # (Megatron then asks the group)

    for cp in (2, 3, 4):
        length = 4 * cp
        for rank in range(cp):
            ours = zigzag_index([length], cp, rank)
            theirs = get_batch_on_this_cp_rank({"tokens": torch.arange(length)[None]}, cp_group=_Group(cp, rank))
            assert torch.equal(ours, theirs["tokens"][0]), (cp, rank)
    assert zigzag_index([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index([8], 2, 1).tolist() == [2, 3, 4, 5]


def test_zigzag_of_a_pack_splits_each_sequence_as_megatrons_thd_rope_does():
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    lengths = [8, 4, 12]
    for cp in (2,):
        stream = torch.arange(sum(lengths))
        every = []
        for rank in range(cp):
            ours = zigzag_index(lengths, cp, rank)
            expected, offset = [], 0
            for length in lengths:
                local = torch.empty(length // cp)
                expected.append(_get_thd_freqs_on_this_cp_rank(rank, cp, local, stream, offset=offset))
                offset += length
            assert torch.equal(ours, torch.cat(expected))
            every.append(ours)
        assert torch.equal(torch.cat(every).sort().values, stream)  # a partition of the stream
    assert torch.equal(zigzag_index(lengths, 1, 0), torch.arange(24))
    with pytest.raises(ValueError, match="cannot be split 2\\*cp=4 ways"):
        zigzag_index([6], 2, 0)


def test_alignment():
    assert pack_alignment(cp=1, tp=4, sequence_parallel=False) == (1, 1)
    assert pack_alignment(cp=1, tp=4, sequence_parallel=True) == (1, 4)
    assert pack_alignment(cp=2, tp=2, sequence_parallel=False) == (4, 4)
    assert pack_alignment(cp=2, tp=4, sequence_parallel=True) == (4, 8)
    assert pack_alignment(cp=3, tp=2, sequence_parallel=True) == (6, 6)
    assert round_up(5, 4) == 8 and round_up(8, 4) == 8


def test_pack_holds_the_real_tokens_end_to_end_and_restores_to_the_callers_layout():
    mb = {"input_ids": IDS, "attention_mask": MASK}
    p = prepare_packed(mb)
    assert p.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 24, 25, 26, 27, 28, 29, 31, 32, 33]]
    assert p.labels[0, :4].tolist() == [12, 13, 14, 21]  # the last token's label is never read
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, *range(9), 0, 1, 2]
    params = p.packed_seq_params
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_q_padded.tolist() == [0, 4, 13, 16]
    assert params.max_seqlen_q == 9 and p.seq_length == 16 and p.micro_batch_size == 1
    back = p.restore(p.input_ids.float())
    assert torch.equal(back, (IDS * MASK).float())  # zeros where the caller has padding; the empty row too


def test_pack_alignment_and_pipeline_length_pad_segments_never_the_tokens():
    mb = {"input_ids": IDS, "attention_mask": MASK}
    p = prepare_packed(mb, seg_align=4, total_align=8, pad_to=32)
    params = p.packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 4, 13, 16]  # real lengths
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 16, 32]  # 4, 12, then 4 + the tail to 32
    assert params.max_seqlen_q == 16 < p.seq_length == 32  # RoPE numbers positions within segments
    assert p.input_ids[0, :4].tolist() == [11, 12, 13, 14] and p.input_ids[0, 4:13].tolist() == list(range(21, 30))
    assert p.input_ids[0, 13:16].tolist() == [0, 0, 0] and p.input_ids[0, 16:19].tolist() == [31, 32, 33]
    assert packed_length(mb, 4, 8) == 24
    assert torch.equal(p.restore(p.input_ids.float()), (IDS * MASK).float())
    with pytest.raises(ValueError, match="pad_to=30 is not a multiple of the alignment 8"):
        prepare_packed(mb, seg_align=4, total_align=8, pad_to=30)
    with pytest.raises(ValueError, match="has no tokens"):
        prepare_packed({"input_ids": IDS[2:3], "attention_mask": MASK[2:3]})
    with pytest.raises(ValueError, match=r"rows \[0\] have padding between tokens"):
        prepare_packed({"input_ids": IDS[:1], "attention_mask": torch.tensor([[1, 0, 1, 1, 1, 1, 0, 0, 0]])})


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_ranks_hold_a_partition_and_labels_come_from_the_full_rows(cp):
    mb = {"input_ids": IDS, "attention_mask": MASK}
    seg, total = pack_alignment(cp=cp, tp=1, sequence_parallel=False)
    whole = prepare_packed(mb, seg_align=seg, total_align=total)
    parts = [prepare_packed(mb, seg_align=seg, total_align=total, cp=cp, cp_rank=r) for r in range(cp)]
    stream = torch.full((whole.seq_length,), -1)
    labels = torch.full((whole.seq_length,), -1)
    for rank, part in enumerate(parts):
        index = zigzag_index(whole.lengths, cp, rank)
        assert part.input_ids.shape == (1, whole.seq_length // cp)
        stream[index], labels[index] = part.input_ids[0], part.labels[0]
        assert part.packed_seq_params.cu_seqlens_q_padded.tolist() == whole.packed_seq_params.cu_seqlens_q_padded.tolist()
    assert torch.equal(stream, whole.input_ids[0]) and torch.equal(labels, whole.labels[0])
    padded = [prepare_padded(mb, total_align=total, cp=cp, cp_rank=r) for r in range(cp)]
    full = prepare_padded(mb, total_align=total)
    assert full.input_ids.shape[1] % (2 * cp) == 0
    for rank, part in enumerate(padded):
        keep = zigzag_index([full.seq_length], cp, rank)
        assert torch.equal(part.input_ids, full.input_ids[:, keep]) and torch.equal(part.labels, full.labels[:, keep])


def test_padded_layout_rotates_rows_pads_for_alignment_and_restores():
    mb = {"input_ids": IDS, "attention_mask": MASK}
    p = prepare_padded(mb, shape=(5, 10), total_align=4)
    assert p.input_ids.shape == (5, 12) and p.seq_length == 12 and p.micro_batch_size == 5
    assert p.input_ids[0, :4].tolist() == [11, 12, 13, 14] and p.input_ids[3, :3].tolist() == [31, 32, 33]
    assert p.labels[0, :3].tolist() == [12, 13, 14]
    assert torch.equal(p.restore(p.input_ids.float()), (IDS * MASK).float())


def test_segment_batches_group_short_segments_and_leave_long_ones_alone():
    from megarl.parallel.packing import CALL_COST_SCORES, segment_batches

    lengths = [20, 500, 16, 0, 24, 496, 300]
    plan = segment_batches(lengths, heads=4)
    batches = plan.batches
    # Longest first; 496 joins 500 (4·(500²−496²) = 15 936 ≤ the cost of a call), 300 does not, the short ones share
    # one call; the empty segment takes none.
    assert 4 * (500**2 - 496**2) <= CALL_COST_SCORES < 4 * (500**2 - 300**2)
    assert [b.segments for b in batches] == [(1, 5), (6,), (4, 0, 2)]
    assert all(b.query_positions is None for b in batches)
    # Outputs come back batch by batch, segment by segment; restore puts them in stream order.
    starts = [0, 20, 520, 536, 536, 560, 1056, 1356]
    produced = torch.cat([torch.arange(starts[i], starts[i + 1]) for b in batches for i in b.segments])
    assert torch.equal(produced[plan.restore], torch.arange(1356))
    assert torch.equal(batches[2].output_index[:30], torch.cat([torch.arange(24), 24 + torch.arange(6)]))
    # Under CP each query's position within its segment (zigzag), padding rows at the segment's full length.
    (batch,) = segment_batches([8, 4], heads=1, cp=2, rank=1).batches
    assert batch.segments == (0, 1)
    assert batch.query_positions.tolist() == [[2, 3, 4, 5], [1, 2, 8, 8]]
    assert batch.output_index.tolist() == [0, 1, 2, 3, 4, 5]  # columns of 4 local rows: 4 of the first, 2 of the next


@pytest.mark.parametrize("cp, rank", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("whole_pack", [False, True])
def test_cpu_thd_rope_equals_megatrons(cp, rank, whole_pack):
    """megatron_patches point 9: one cached index per pack selects what Megatron's per-sequence loop selects."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.parallel import megatron_patches

    before = rope_utils._apply_rotary_pos_emb_thd
    megatron_patches._patch_thd_rope()
    patched = rope_utils._apply_rotary_pos_emb_thd
    megatron = patched.megatron
    try:
        bounds = torch.tensor([0, 8, 12, 24], dtype=torch.int32)  # padded sequences of 8, 4 and 12 tokens
        generator = torch.Generator().manual_seed(cp + rank)
        t = torch.randn(int(bounds[-1]) // cp, 2, 16, generator=generator)
        # Megatron's table: the longest sequence's positions, or (offset mode) the whole pack's.
        freqs = torch.randn(24 if whole_pack else 12, 1, 1, 16, generator=generator)
        got = patched(t, bounds, freqs, cp_group=_Group(cp, rank))
        assert torch.equal(got, megatron(t, bounds, freqs, cp_group=_Group(cp, rank)))
        assert not torch.equal(got, t)
    finally:
        rope_utils._apply_rotary_pos_emb_thd = before


@pytest.mark.parametrize("cp", [1, 2])
def test_a_per_token_input_reaches_the_models_layout_as_the_tokens_do(cp):
    """``Prepared.to_model``: a per-token input (the routed experts a replay needs) lands where each token lands,
    packed or padded and rotated, on every CP rank; trailing dims ride along; positions without a token get
    ``fill``."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (3, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0]])
    micro = {"input_ids": ids, "attention_mask": mask}
    for rank in range(cp):
        for prepared in (prepare_packed(micro, seg_align=2 * cp, total_align=4, cp=cp, cp_rank=rank),
                         prepare_padded(micro, shape=(4, 9), total_align=4, cp=cp, cp_rank=rank)):
            assert torch.equal(prepared.to_model(ids, fill=0), prepared.input_ids)
            pairs = prepared.to_model(torch.stack([ids, -ids], dim=-1), fill=torch.tensor([7, 7]))
            assert torch.equal(pairs[..., 1], torch.where(prepared.input_ids == 0, 7, -prepared.input_ids))
