"""PromptDataset and collate: templating, filtering, truncation, padding, carried fields, errors.

The tokenizer is byte-level with no merges (one token per byte, one per special token), so
token counts are written out by hand: ``<|im_start|>user\\nWhat is 2 + 3?<|im_end|>\\n
<|im_start|>assistant\\n`` is 1 + 5 + 14 + 1 + 1 + 1 + 10 = 33 tokens.
"""

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megarl.data import Batch, PromptDataset, collate, truncate_ids

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PAD_ID, IM_START_ID, IM_END_ID = 258, 256, 257


def build_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: bytes are ids 0-255 (in ByteLevel alphabet order),
    ``<|im_start|>`` 256, ``<|im_end|>`` 257 (eos), ``<|pad|>`` 258 (pad)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>", "<|pad|>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def gsm_row(question: str, ground_truth: str, index: int | None, **extra) -> dict:
    extra_info = {"split": "train", **extra}
    if index is not None:
        extra_info["index"] = index
    return {"data_source": "openai/gsm8k", "prompt": user(question), "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": extra_info}


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def three_rows(tmp_path):
    # Templated lengths: 33, 34 and 41 tokens (19 + len(question)).
    rows = [gsm_row("What is 2 + 3?", "5", 7), gsm_row("What is 12 + 3?", "15", 8),
            gsm_row("What is 2 + 3 + 4 + 5?", "14", None)]
    return write_parquet(tmp_path / "train.parquet", rows)


def test_byte_tokenizer_counts_as_documented(tokenizer):
    text = tokenizer.apply_chat_template(user("What is 2 + 3?"), add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 33 and ids[0] == IM_START_ID and ids[20] == IM_END_ID and ids[22] == IM_START_ID


def test_rows_are_templated_with_generation_prompt_and_keep_columns(tokenizer, three_rows):
    dataset = PromptDataset(three_rows, tokenizer, max_prompt_length=64, return_raw_chat=True,
                            return_full_prompt=True)
    assert len(dataset) == 3 and dataset.num_rows_read == 3 and dataset.num_filtered_overlong == 0
    row = dataset[0]
    text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert row["full_prompts"] == text
    assert row["input_ids"].dtype == torch.long and row["input_ids"].shape == (33,)
    assert row["input_ids"].tolist() == row["raw_prompt_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert row["raw_prompt"] == user("What is 2 + 3?")
    assert "prompt" not in row
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "5"}
    assert row["index"] == 7 and dataset[1]["index"] == 8
    # No extra_info.index: the row's number over all files.
    assert dataset[2]["index"] == 2
    assert row["tools_kwargs"] == {} and row["interaction_kwargs"] == {}
    assert [len(dataset[i]["raw_prompt_ids"]) for i in range(3)] == [33, 34, 41]


def test_raw_chat_and_full_prompt_are_off_by_default(tokenizer, three_rows):
    row = PromptDataset(three_rows, tokenizer, max_prompt_length=64)[0]
    assert "raw_prompt" not in row and "full_prompts" not in row


def test_overlong_prompts_are_filtered_counted_and_reported(tokenizer, three_rows, tmp_path, caplog):
    second = write_parquet(tmp_path / "more.parquet", [gsm_row("What is 1 + 1?", "2", 0),
                                                       gsm_row("What is 10 + 10?", "20", 1)])
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = PromptDataset([three_rows, second], tokenizer, max_prompt_length=33)
    # 33 tokens fit exactly; 34 and 41 (train rows 1 and 2) and 35 (more row 1) do not.
    assert dataset.num_rows_read == 5 and len(dataset) == 2 and dataset.num_filtered_overlong == 3
    assert [(p.file.rsplit("/", 1)[1], p.row, p.num_tokens) for p in dataset.filtered_overlong] == [
        ("train.parquet", 1, 34), ("train.parquet", 2, 41), ("more.parquet", 1, 35)]
    assert [dataset[i]["reward_model"]["ground_truth"] for i in range(2)] == ["5", "2"]
    # Global row number of the kept second-file row: 3 rows before it, but its extra_info has index 0.
    assert dataset[1]["index"] == 0
    message = caplog.text
    assert "dropped 3 of 5 rows" in message and "max_prompt_length=33" in message
    assert "train.parquet row 1 (34 tokens)" in message and "more.parquet row 1 (35 tokens)" in message


@pytest.mark.parametrize("mode, expected", [("left", [6, 7, 8, 9]), ("right", [0, 1, 2, 3]),
                                            ("middle", [0, 1, 8, 9])])
def test_truncate_ids_modes(mode, expected):
    assert truncate_ids(list(range(10)), 4, mode, "here") == expected
    assert truncate_ids(list(range(3)), 4, mode, "here") == [0, 1, 2]


def test_truncate_middle_odd_budget_and_error():
    assert truncate_ids(list(range(10)), 5, "middle", "x") == [0, 1, 7, 8, 9]
    with pytest.raises(ValueError, match=r"row 4: the templated prompt has 10 tokens, more than "
                                         r"data.max_prompt_length=5"):
        truncate_ids(list(range(10)), 5, "error", "f.parquet row 4")


def test_unfiltered_overlong_prompts_meet_truncation(tokenizer, three_rows):
    strict = PromptDataset(three_rows, tokenizer, max_prompt_length=33, filter_overlong_prompts=False)
    assert len(strict) == 3 and strict.num_filtered_overlong == 0
    assert strict[0]["input_ids"].shape == (33,)
    with pytest.raises(ValueError, match=r"train.parquet row 1: the templated prompt has 34 tokens.*"
                                         r"filter_overlong_prompts"):
        strict[1]
    full = PromptDataset(three_rows, tokenizer, max_prompt_length=64)[1]["raw_prompt_ids"]
    left = PromptDataset(three_rows, tokenizer, max_prompt_length=33, filter_overlong_prompts=False,
                         truncation="left")[1]
    right = PromptDataset(three_rows, tokenizer, max_prompt_length=33, filter_overlong_prompts=False,
                          truncation="right")[1]
    assert left["raw_prompt_ids"] == full[1:] and left["input_ids"].tolist() == full[1:]
    assert right["raw_prompt_ids"] == full[:33]
    # Left truncation drops the leading <|im_start|> and keeps the generation prompt.
    assert left["raw_prompt_ids"][-11] == IM_START_ID and full[0] == IM_START_ID


def test_collate_left_pads_and_carries_non_tensors(tokenizer, three_rows):
    dataset = PromptDataset(three_rows, tokenizer, max_prompt_length=36, return_raw_chat=True)
    batch = dataset.collate([dataset[0], dataset[1]])
    assert isinstance(batch, Batch) and len(batch) == 2
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    assert ids.shape == mask.shape == pos.shape == (2, 36)
    assert ids[0, :3].tolist() == [PAD_ID] * 3 and ids[0, 3].item() == IM_START_ID
    assert ids[1, :2].tolist() == [PAD_ID] * 2 and ids[1, 2:].tolist() == dataset[1]["raw_prompt_ids"]
    assert mask[0].tolist() == [0] * 3 + [1] * 33 and mask[1].tolist() == [0] * 2 + [1] * 34
    assert pos[0].tolist() == [0, 0, 0] + list(range(33)) and pos[1].tolist() == [0, 0] + list(range(34))
    assert set(batch.non_tensors) == {"raw_prompt_ids", "raw_prompt", "data_source", "ability", "reward_model",
                                      "extra_info", "index", "tools_kwargs", "interaction_kwargs"}
    assert batch["data_source"].dtype == object and list(batch["index"]) == [7, 8]
    assert batch["reward_model"][1] == {"style": "rule", "ground_truth": "15"}
    assert batch["raw_prompt"][0] == user("What is 2 + 3?")


def test_collate_pads_to_longest_without_pad_to_and_checks_rows():
    rows = [{"input_ids": torch.tensor([5, 6]), "tag": "a"}, {"input_ids": torch.tensor([7]), "tag": "b"}]
    batch = collate(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6], [0, 7]] and batch["position_ids"].tolist() == [[0, 1], [0, 0]]
    with pytest.raises(ValueError, match=r"row 1 has keys \['input_ids'\] but row 0 has \['input_ids', 'tag'\]"):
        collate([rows[0], {"input_ids": torch.tensor([1])}], pad_token_id=0)
    with pytest.raises(ValueError, match=r"a prompt has 2 tokens, more than pad_to=1"):
        collate(rows, pad_token_id=0, pad_to=1)


def test_dataloader_with_dataset_collate(tokenizer, three_rows):
    dataset = PromptDataset(three_rows, tokenizer, max_prompt_length=48)
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, shuffle=False, collate_fn=dataset.collate)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (3, 48) and batch["attention_mask"].sum(1).tolist() == [33, 34, 41]


def test_tools_kwargs_lose_parquet_nulls_and_missing_ones_are_counted(tokenizer, tmp_path, caplog):
    rows = [gsm_row("What is 2 + 3?", "5", 0, need_tools_kwargs=True,
                    tools_kwargs={"calc": {"create_kwargs": {"ground_truth": "5"}}},
                    interaction_kwargs={"query": "q", "ground_truth": "5"}),
            gsm_row("What is 2 + 4?", "6", 1, need_tools_kwargs=True,
                    tools_kwargs={"calc": {"execute_kwargs": {"city": "x"}}}),
            gsm_row("What is 2 + 5?", "7", 2, need_tools_kwargs=True)]
    path = write_parquet(tmp_path / "tools.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = PromptDataset(path, tokenizer, max_prompt_length=64)
    # Parquet unions the struct fields: row 0 would read execute_kwargs=None without cleaning.
    assert dataset[0]["tools_kwargs"] == {"calc": {"create_kwargs": {"ground_truth": "5"}}}
    assert dataset[1]["tools_kwargs"] == {"calc": {"execute_kwargs": {"city": "x"}}}
    assert dataset[0]["interaction_kwargs"] == {"query": "q", "ground_truth": "5"}
    assert dataset[2]["tools_kwargs"] == {} and dataset.num_missing_tools_kwargs == 1
    assert "tools.parquet row 2" in caplog.text


def test_need_tools_kwargs_setting_is_the_default_of_the_row_flag(tokenizer, three_rows):
    assert PromptDataset(three_rows, tokenizer, max_prompt_length=64).num_missing_tools_kwargs == 0
    assert PromptDataset(three_rows, tokenizer, max_prompt_length=64,
                         need_tools_kwargs=True).num_missing_tools_kwargs == 3


def test_errors_name_the_setting_file_and_row(tokenizer, tmp_path, three_rows):
    with pytest.raises(FileNotFoundError, match=r"nope.parquet.*data.train_files"):
        PromptDataset(str(tmp_path / "nope.parquet"), tokenizer)
    with pytest.raises(ValueError, match=r"no column 'messages' \(data.prompt_key\)"):
        PromptDataset(three_rows, tokenizer, prompt_key="messages")
    with pytest.raises(ValueError, match=r"data.truncation='cut' is unknown"):
        PromptDataset(three_rows, tokenizer, truncation="cut")
    number = write_parquet(tmp_path / "number.parquet", [{"prompt": 5}])  # a string is one user message
    with pytest.raises(ValueError, match=r"number.parquet row 0: the prompt must be a list of chat messages"):
        PromptDataset(number, tokenizer)
    clash = write_parquet(tmp_path / "clash.parquet", [{"prompt": user("hi"), "index": 3}])
    with pytest.raises(ValueError, match=r"columns \['index'\] clash"):
        PromptDataset(clash, tokenizer)
    with pytest.raises(ValueError, match=r"has no chat template"):
        PromptDataset(three_rows, build_tokenizer(chat_template=None))


def test_apply_chat_template_kwargs_reach_the_template(tokenizer, tmp_path):
    templated = build_tokenizer("{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    path = write_parquet(tmp_path / "x.parquet", [{"prompt": user("abc")}])
    row = PromptDataset(path, templated, max_prompt_length=8, return_full_prompt=True,
                        apply_chat_template_kwargs={"greeting": "hi "})[0]
    assert row["full_prompts"] == "hi abc" and row["input_ids"].shape == (6,)


def test_the_length_filter_counts_the_tool_schemas_of_each_row(tokenizer, tmp_path):
    """With multi-turn tools the chat template adds each row's tool schemas to its prompt; the filter
    counts them (the row's tools: those its tools_kwargs names, else all), and so does the row's input_ids."""
    # (transformers renders with trim_blocks: the newline after {% endfor %} goes)
    templated = build_tokenizer("{% if tools %}{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n"
                                "{% endif %}" + CHAT_TEMPLATE)
    question = "What is 2 + 3?"  # 33 tokens without tools
    rows = [gsm_row(question, "5", 0, tools_kwargs={"calc": {"create_kwargs": {"ground_truth": "5"}}}),
            gsm_row(question, "5", 1),  # no tools_kwargs: every tool ("calc;search;", 12 tokens)
            gsm_row(question, "5", 2, tools_kwargs={"search": {"create_kwargs": {"q": "x"}}})]  # "search;": 7
    path = write_parquet(tmp_path / "tools.parquet", rows)
    schemas = {name: {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
               for name in ("calc", "search")}
    dataset = PromptDataset(path, templated, max_prompt_length=39, tool_schemas=schemas)
    assert [(p.row, p.num_tokens) for p in dataset.filtered_overlong] == [(1, 45), (2, 40)]
    assert len(dataset) == 1 and dataset[0]["input_ids"].shape == (38,)  # "calc;" + 33
    assert PromptDataset(path, templated, max_prompt_length=39).num_filtered_overlong == 0  # without tools
    with pytest.raises(ValueError, match="apply_chat_template_kwargs.tools and multi-turn tools are both set"):
        PromptDataset(path, templated, tool_schemas=schemas, apply_chat_template_kwargs={"tools": []})


def test_prompt_loader_batches_by_number_across_epochs():
    from megarl.data.loader import PromptLoader

    class Rows(list):
        def collate(self, rows):
            return rows

    loader = PromptLoader(Rows(range(10)), 3, shuffle=True, seed=5)  # 3 batches per epoch (drop_last)
    numbers = [loader.rows_of(b) for b in range(7)]
    read = [loader.next() for _ in range(7)]
    assert read == numbers and loader.position == 7
    assert numbers[3] != numbers[0]  # epoch 1 has its own order
    other = PromptLoader(Rows(range(10)), 3, shuffle=True, seed=5)
    other.seek(4)
    assert other.state_dict() == {"epoch": 1, "index": 1} and other.next() == numbers[4]
