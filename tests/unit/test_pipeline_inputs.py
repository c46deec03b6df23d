"""Row alignment used for padded micro-batches: exact positions for padded RL batches."""

import pytest
import torch

from megarl.parallel.packing import left_align, prepare_padded


def test_left_align_moves_tokens_to_the_front_and_back():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    ids = torch.arange(24).reshape(4, 6)
    index = left_align(mask)
    aligned = torch.gather(ids, 1, index)
    assert aligned[0, :3].tolist() == [2, 3, 4]
    assert aligned[1, :4].tolist() == [6, 7, 8, 9]
    assert aligned[2].tolist() == ids[2].tolist()
    assert torch.equal(torch.zeros_like(aligned).scatter(1, index, aligned), ids)


def test_padding_between_tokens_is_refused_with_row_numbers():
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] have padding between tokens"):
        left_align(mask)


def test_prepare_pads_to_pipeline_shape():
    mb = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[0, 1, 1]])}
    p = prepare_padded(mb, shape=(2, 5))
    assert p.input_ids.shape == p.position_ids.shape == p.align_index.shape == (2, 5)
    assert p.input_ids[0, :2].tolist() == [6, 7]
    assert p.position_ids[1].tolist() == [0, 1, 2, 3, 4]
