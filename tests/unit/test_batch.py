"""The Batch container: every operation, its edge cases and its error messages."""

import pickle

import numpy as np
import pytest
import torch

from megarl.data import Batch


def make_batch(num_rows: int = 4) -> Batch:
    """Rows 0..num_rows-1: ids [[10*i, 10*i+1]], uid 'p{i}', dict extras; meta with temperature."""
    ids = torch.arange(2 * num_rows).reshape(num_rows, 2) + torch.arange(num_rows).unsqueeze(-1) * 8
    return Batch.from_dict({"input_ids": ids, "score": torch.arange(num_rows, dtype=torch.float32),
                            "uid": [f"p{i}" for i in range(num_rows)],
                            "extra_info": [{"index": i} for i in range(num_rows)]},
                           meta={"temperature": 1.0})


def uids(batch: Batch) -> list:
    return list(batch["uid"])


def test_from_dict_sorts_fields_and_keeps_lists_as_object_rows():
    batch = Batch.from_dict({"x": torch.zeros(2, 3), "tokens": [[1, 2, 3], [4]], "name": np.array(["a", "b"])})
    assert set(batch.tensors) == {"x"} and set(batch.non_tensors) == {"tokens", "name"}
    # A ragged list of lists stays one Python object per row.
    assert batch["tokens"].dtype == object and batch["tokens"].shape == (2,)
    assert batch["tokens"][0] == [1, 2, 3]
    assert len(batch) == 2 and "x" in batch and "y" not in batch


def test_mismatched_lengths_name_both_fields():
    with pytest.raises(ValueError, match=r"'b' has 3 rows but 'a' has 2"):
        Batch(tensors={"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'uid' has 3 rows"):
        Batch(tensors={"a": torch.zeros(2)}, non_tensors={"uid": ["x", "y", "z"]})


def test_bad_field_values_are_refused():
    with pytest.raises(ValueError, match="0-dim tensor.*meta"):
        Batch(tensors={"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="non_tensors"):
        Batch(tensors={"a": [1, 2]})
    with pytest.raises(TypeError, match="'a' has type int"):
        Batch(non_tensors={"a": 3})
    with pytest.raises(ValueError, match="both tensor and non-tensor"):
        Batch(tensors={"a": torch.zeros(2)}, non_tensors={"a": ["x", "y"]})


def test_missing_key_error_names_the_key_and_what_exists():
    batch = make_batch()
    with pytest.raises(KeyError, match="no field 'advantages' to read.*input_ids"):
        batch["advantages"]
    with pytest.raises(KeyError, match="'values' to select"):
        batch.select("input_ids", "values")
    with pytest.raises(KeyError, match="'values' to pop"):
        batch.pop("input_ids", "values")
    with pytest.raises(KeyError, match="no keys \\['lr'\\]"):
        batch.select("input_ids", meta_keys=["lr"])


def test_setitem_checks_rows_and_replaces_fields():
    batch = make_batch(3)
    batch["values"] = torch.ones(3, 2)
    batch["tag"] = ["a", "b", "c"]
    assert batch["values"].shape == (3, 2) and list(batch["tag"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="'values' with 2 rows on a batch of 3"):
        batch["values"] = torch.ones(2, 2)
    single = Batch(tensors={"a": torch.zeros(2)})
    single["a"] = torch.zeros(5)  # replacing the only field may change the row count
    assert len(single) == 5


def test_select_keeps_rows_and_copies_meta():
    batch = make_batch()
    picked = batch.select("input_ids", "uid")
    assert picked.keys() == ["input_ids", "uid"]
    assert torch.equal(picked["input_ids"], batch["input_ids"])
    picked.meta["temperature"] = 0.5
    assert batch.meta["temperature"] == 1.0
    assert batch.select("score", meta_keys=[]).meta == {}


def test_pop_is_in_place_and_all_or_nothing():
    batch = make_batch()
    popped = batch.pop("input_ids", "uid")
    assert popped.keys() == ["input_ids", "uid"] and popped.meta == {"temperature": 1.0}
    assert batch.keys() == ["score", "extra_info"]
    with pytest.raises(KeyError):
        batch.pop("score", "input_ids")
    assert batch.keys() == ["score", "extra_info"]  # nothing removed by the failed pop


def test_union_merges_equal_overlap_and_refuses_conflicts():
    left = make_batch().select("input_ids", "uid")
    right = make_batch().select("input_ids", "score")
    right.meta["multi_turn"] = True
    merged = left.union(right)
    assert merged.keys() == ["input_ids", "score", "uid"]
    assert merged.meta == {"temperature": 1.0, "multi_turn": True}
    assert left.keys() == ["input_ids", "uid"]  # inputs untouched

    conflicting = make_batch()
    conflicting["input_ids"] = conflicting["input_ids"] + 1
    with pytest.raises(ValueError, match="field 'input_ids' is in both with different values"):
        left.union(conflicting)
    other_uid = make_batch().select("uid")
    other_uid["uid"] = ["x", "y", "z", "w"]
    with pytest.raises(ValueError, match="'uid' is in both"):
        left.union(other_uid)
    with pytest.raises(ValueError, match="4 and 3 rows"):
        left.union(make_batch(3))
    hot = make_batch()
    hot.meta["temperature"] = 0.7
    with pytest.raises(ValueError, match=r"meta\['temperature'\] is 1.0 on one side and 0.7"):
        left.union(hot)


def test_union_with_a_meta_only_batch():
    batch = make_batch()
    merged = batch.union(Batch(meta={"global_steps": 3}))
    assert len(merged) == 4 and merged.meta["global_steps"] == 3
    assert len(Batch(meta={"a": 1}).union(batch)) == 4


def test_repeat_interleaved_keeps_samples_of_a_prompt_adjacent():
    batch = make_batch(2)
    repeated = batch.repeat(3)
    assert uids(repeated) == ["p0", "p0", "p0", "p1", "p1", "p1"]
    assert repeated["score"].tolist() == [0, 0, 0, 1, 1, 1]
    assert [e["index"] for e in repeated["extra_info"]] == [0, 0, 0, 1, 1, 1]
    tiled = batch.repeat(2, interleave=False)
    assert uids(tiled) == ["p0", "p1", "p0", "p1"]
    assert tiled["input_ids"].tolist() == [batch["input_ids"][0].tolist(), batch["input_ids"][1].tolist()] * 2
    assert repeated.meta == batch.meta
    with pytest.raises(ValueError, match="n >= 1.*rollout.n"):
        batch.repeat(0)


def test_chunk_concat_round_trip_and_divisibility():
    batch = make_batch(6)
    chunks = batch.chunk(3)
    assert [uids(c) for c in chunks] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    joined = Batch.concat(chunks)
    assert torch.equal(joined["input_ids"], batch["input_ids"]) and uids(joined) == uids(batch)
    with pytest.raises(ValueError, match="6 rows do not divide into 4.*pad_to_divisor\\(4\\)"):
        batch.chunk(4)


def test_split_by_size_or_sizes():
    batch = make_batch(5)
    assert [len(p) for p in batch.split(2)] == [2, 2, 1]
    assert [uids(p) for p in batch.split([1, 0, 4])] == [["p0"], [], ["p1", "p2", "p3", "p4"]]
    with pytest.raises(ValueError, match="sum to the 5 rows"):
        batch.split([2, 2])
    with pytest.raises(ValueError, match="piece size >= 1"):
        batch.split(0)


def test_concat_refuses_different_fields():
    with pytest.raises(ValueError, match="differ in fields \\['score'\\]"):
        Batch.concat([make_batch(2), make_batch(2).select("input_ids", "uid", "extra_info")])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
    first, second = make_batch(1), make_batch(1)
    second.meta["temperature"] = 9.0
    assert Batch.concat([first, second]).meta["temperature"] == 1.0


def test_reorder_permutes_selects_and_checks_indices():
    batch = make_batch(4)
    assert uids(batch.reorder([2, 0, 3, 1])) == ["p2", "p0", "p3", "p1"]
    assert uids(batch.reorder(torch.tensor([3, 3]))) == ["p3", "p3"]
    assert uids(batch.reorder(np.array([-1]))) == ["p3"]
    assert batch.reorder([2, 0])["score"].tolist() == [2.0, 0.0]
    with pytest.raises(ValueError, match="out of range for a batch of 4 rows"):
        batch.reorder([4])
    with pytest.raises(ValueError, match="1-D integer index"):
        batch.reorder(torch.tensor([0.0, 1.0]))


def test_pad_to_divisor_and_back():
    batch = make_batch(5)
    padded, num_pad = batch.pad_to_divisor(4)
    assert num_pad == 3 and len(padded) == 8
    assert uids(padded) == ["p0", "p1", "p2", "p3", "p4", "p0", "p1", "p2"]  # real rows, cycled
    restored = padded.unpad(num_pad)
    assert torch.equal(restored["input_ids"], batch["input_ids"]) and uids(restored) == uids(batch)
    # Pad more rows than there are: rows cycle again.
    padded, num_pad = make_batch(2).pad_to_divisor(5)
    assert num_pad == 3 and uids(padded) == ["p0", "p1", "p0", "p1", "p0"]
    same, num_pad = batch.pad_to_divisor(5)
    assert num_pad == 0 and len(same) == 5
    with pytest.raises(ValueError, match="num_pad=6"):
        batch.unpad(6)
    with pytest.raises(ValueError, match="divisor >= 1"):
        batch.pad_to_divisor(0)


def test_split_by_dp_rank_after_padding():
    batch = make_batch(5)
    padded, num_pad = batch.pad_to_divisor(2)
    shards = [padded.shard(rank, 2) for rank in range(2)]
    assert [uids(s) for s in shards] == [["p0", "p1", "p2"], ["p3", "p4", "p0"]]
    assert uids(Batch.concat(shards).unpad(num_pad)) == uids(batch)
    with pytest.raises(ValueError, match="do not divide over dp_size=2.*pad_to_divisor\\(2\\)"):
        batch.shard(0, 2)
    with pytest.raises(ValueError, match="dp_rank=2, dp_size=2"):
        padded.shard(2, 2)


def test_empty_batch_operations():
    empty = Batch()
    assert len(empty) == 0 and empty.keys() == []
    assert len(empty.repeat(3)) == 0 and empty.pad_to_divisor(4)[1] == 0
    zero_rows = Batch.from_dict({"x": torch.zeros(0, 3), "uid": np.array([], dtype=object)})
    assert len(zero_rows) == 0
    assert [len(c) for c in zero_rows.chunk(2)] == [0, 0]
    assert zero_rows.split(4) == []
    assert len(zero_rows.repeat(2)) == 0 and zero_rows.repeat(2)["x"].shape == (0, 3)
    assert len(Batch.concat([zero_rows, zero_rows])) == 0
    assert len(zero_rows.reorder([])) == 0
    assert zero_rows.pad_to_divisor(3)[1] == 0
    assert len(zero_rows.shard(1, 2)) == 0


def test_rename_and_to():
    batch = make_batch(2)
    renamed = batch.rename("score", "acc")
    assert "acc" in renamed and "score" not in renamed and "score" in batch
    with pytest.raises(ValueError, match="'uid' exists"):
        batch.rename("score", "uid")
    moved = batch.to("cpu")
    assert moved["input_ids"].device.type == "cpu" and uids(moved) == uids(batch)


def test_pickle_round_trip():
    batch = make_batch(3)
    batch.meta["metrics"] = {"a": 1.5}
    loaded = pickle.loads(pickle.dumps(batch))
    assert loaded.keys() == batch.keys() and loaded.meta == batch.meta
    assert torch.equal(loaded["input_ids"], batch["input_ids"])
    assert uids(loaded) == uids(batch) and list(loaded["extra_info"]) == list(batch["extra_info"])


def test_split_pieces_are_views():
    batch = make_batch(4)
    first = batch.split(2)[0]
    first["score"][0] = 100.0
    assert batch["score"][0] == 100.0
