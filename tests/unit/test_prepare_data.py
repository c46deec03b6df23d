"""tools/prepare_gsm8k.py and tools/make_addition_data.py: their files load in PromptDataset and score.

GSM8K inputs are written by the tests in the published formats (JSON lines with ``question``
and ``answer``; parquet with the same columns); nothing is downloaded.
"""

import importlib.util
import json
import logging
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megarl.data import Batch, PromptDataset
from megarl.reward import RewardManager, addition
from tests.unit.test_dataset import IM_END_ID, PAD_ID, build_tokenizer

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    """Import ``tools/<name>.py`` as a module (tools/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


prepare = load_tool("prepare_gsm8k")
make_addition = load_tool("make_addition_data")

NATALIA_Q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?")
NATALIA_A = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
             "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
WENG_Q = "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much?"
WENG_A = "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $10.\n#### 10"
BIG_A = "He pays 2*800 = 1,600 in total.\n#### 1,600"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def gsm8k_jsonl(tmp_path):
    """Records 0 and 4 are valid; 1 has no '####', 2 no question, 3 is not JSON; a blank line is no record."""
    return write_jsonl(tmp_path / "train.jsonl", [
        json.dumps({"question": NATALIA_Q, "answer": NATALIA_A}),
        json.dumps({"question": "What is 1 + 1?", "answer": "It is 2."}),
        json.dumps({"answer": "#### 3"}),
        '{"question": "broken", "answer": ',
        "",
        json.dumps({"question": WENG_Q, "answer": WENG_A}),
    ])


def test_plain_variant_rows_load_and_malformed_rows_are_reported(tokenizer, gsm8k_jsonl, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="prepare_gsm8k"):
        reports = prepare.prepare_gsm8k(tmp_path / "out", train=gsm8k_jsonl)
    report = reports["train"]
    assert (report.num_read, report.num_written) == (5, 2)
    assert [(s.split, s.index) for s in report.skipped] == [("train", 1), ("train", 2), ("train", 3)]
    assert report.skipped[0].reason == "the answer has no '#### <number>'"
    assert report.skipped[1].reason == "missing or empty 'question'"
    assert report.skipped[2].reason.startswith("line 4 is not valid JSON")
    assert "skipped train index 2: missing or empty 'question'" in caplog.text

    dataset = PromptDataset(tmp_path / "out" / "train.parquet", tokenizer, max_prompt_length=512,
                            return_raw_chat=True)
    assert len(dataset) == 2 and dataset.num_filtered_overlong == 0
    row = dataset[0]
    assert row["raw_prompt"] == [{"role": "user", "content": NATALIA_Q + " " + prepare.INSTRUCTION}]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert row["extra_info"] == {"split": "train", "index": 0, "answer": NATALIA_A, "question": NATALIA_Q}
    assert row["index"] == 0 and dataset[1]["index"] == 4 and dataset[1]["reward_model"]["ground_truth"] == "10"
    assert row["tools_kwargs"] == {} and row["interaction_kwargs"] == {}
    # <|im_start|>user\n (6) + content + <|im_end|>\n<|im_start|>assistant\n (13)
    assert row["input_ids"].shape == (6 + len(NATALIA_Q) + 1 + len(prepare.INSTRUCTION) + 13,)


def test_tool_variant_from_parquet_has_system_prompt_and_tools_kwargs(tokenizer, tmp_path):
    source = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "Q one?", "answer": BIG_A},
                                         {"question": "Q two?", "answer": None},
                                         {"question": WENG_Q, "answer": WENG_A}]), source)
    reports = prepare.prepare_gsm8k(tmp_path / "out", test=source, variant="tool")
    assert list(reports) == ["test"] and [s.index for s in reports["test"].skipped] == [1]
    assert not (tmp_path / "out" / "train.parquet").exists()
    dataset = PromptDataset(tmp_path / "out" / "test.parquet", tokenizer, max_prompt_length=1024,
                            return_raw_chat=True)
    assert len(dataset) == 2 and dataset.num_missing_tools_kwargs == 0
    row = dataset[0]
    assert row["raw_prompt"] == [{"role": "system", "content": prepare.TOOL_SYSTEM_PROMPT},
                                 {"role": "user", "content": "Q one? " + prepare.INSTRUCTION}]
    assert "`calc_gsm8k_reward` tool" in prepare.TOOL_SYSTEM_PROMPT and "#### <answer>" in prepare.TOOL_SYSTEM_PROMPT
    assert row["reward_model"]["ground_truth"] == "1600"
    assert row["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1600"}}}
    assert row["interaction_kwargs"] == {"query": "Q one?", "ground_truth": "1600"}
    assert row["extra_info"]["need_tools_kwargs"] is True and dataset[1]["index"] == 2


def test_a_file_without_usable_records_is_refused(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"q": "x", "a": "y"}), json.dumps([1, 2])])
    with pytest.raises(ValueError, match=r"no usable GSM8K record among 2 \(index 0: missing or empty 'question'; "
                                         r"index 1: not a JSON object but list\)"):
        prepare.prepare_gsm8k(tmp_path / "out", train=bad)
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl' does not exist"):
        prepare.prepare_gsm8k(tmp_path / "out", train=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"variant 'chat' is unknown"):
        prepare.convert_records([], "train", "chat")


def test_prepare_gsm8k_cli(gsm8k_jsonl, tmp_path):
    assert prepare.main(["--train", str(gsm8k_jsonl), "--test", str(gsm8k_jsonl), "--out", str(tmp_path / "cli"),
                         "--variant", "tool"]) == 0
    assert pq.read_table(tmp_path / "cli" / "test.parquet").num_rows == 2


def test_gsm8k_rows_through_collate_and_reward_manager(tokenizer, gsm8k_jsonl, tmp_path):
    prepare.prepare_gsm8k(tmp_path / "out", train=gsm8k_jsonl)
    dataset = PromptDataset(tmp_path / "out" / "train.parquet", tokenizer, max_prompt_length=512)
    prompts = dataset.collate([dataset[0], dataset[1]])
    responses = torch.full((2, 12), PAD_ID)
    mask = torch.zeros((2, 12), dtype=torch.long)
    for i, text in enumerate(["#### 72", "so #### 11"]):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [IM_END_ID]
        responses[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
    batch = prompts.union(Batch(tensors={"responses": responses, "response_mask": mask}))
    scores, info = RewardManager(tokenizer)(batch)
    assert scores[0, 7] == 1.0 and scores[1].abs().sum() == 0.0 and scores.sum() == 1.0
    assert info["pred"] == ["72", "11"] and info["acc"] == [1.0, 0.0]


def test_addition_data_loads_and_its_ground_truths_score_one(tokenizer, tmp_path):
    paths = make_addition.write_addition_data(tmp_path / "add", num_train=40, num_test=10, seed=3)
    train = PromptDataset(paths["train"], tokenizer, max_prompt_length=64, return_raw_chat=True)
    test = PromptDataset(paths["test"], tokenizer, max_prompt_length=64)
    assert (len(train), len(test)) == (40, 10)
    pairs = set()
    for dataset in (train, test):
        for i in range(len(dataset)):
            row = dataset[i]
            a, b = row["extra_info"]["operands"]
            assert 10 <= a <= 99 and 10 <= b <= 99 and row["data_source"] == "addition"
            assert row["reward_model"]["ground_truth"] == str(a + b) == row["extra_info"]["answer"]
            assert addition.score_response(row["reward_model"]["ground_truth"], row["reward_model"]["ground_truth"],
                                           row["extra_info"])["score"] == 1.0
            pairs.add((a, b))
    assert len(pairs) == 50  # train and test problems are distinct
    first = train[0]
    a, b = first["extra_info"]["operands"]
    assert first["raw_prompt"] == [{"role": "user", "content": f"What is {a} + {b}?"}]
    # <|im_start|>user\n (6) + "What is NN + NN?" (16) + <|im_end|>\n<|im_start|>assistant\n (13)
    assert first["input_ids"].shape == (35,) and first["index"] == 0 and first["extra_info"]["split"] == "train"


def test_addition_data_is_seeded_and_sizes_are_checked(tmp_path):
    one = make_addition.make_addition_rows(5, 2, seed=7)
    assert one == make_addition.make_addition_rows(5, 2, seed=7)
    assert one != make_addition.make_addition_rows(5, 2, seed=8)
    assert make_addition.make_addition_rows(8000, 100, seed=0)["test"][-1]["extra_info"]["index"] == 99
    with pytest.raises(ValueError, match=r"exceeds the 8100 distinct 2-digit additions"):
        make_addition.make_addition_rows(8100, 1)
    with pytest.raises(ValueError, match=r"need --num-train >= 1"):
        make_addition.make_addition_rows(0, 1)
    assert make_addition.main(["--out", str(tmp_path / "cli"), "--num-train", "3", "--num-test", "0"]) == 0
    assert pq.read_table(tmp_path / "cli" / "train.parquet").num_rows == 3
    assert not (tmp_path / "cli" / "test.parquet").exists()
