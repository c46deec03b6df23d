"""Prompt data as parquet, JSON and JSONL; slime-style column mapping (data.label_key, data.data_source,
data.data_source_key, data.metadata_key); the run-input checks of every format."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.config import load_config
from megarl.controller.run_inputs import _check_data
from megarl.data import PromptDataset
from megarl.data.files import read_columns, read_table
from tests.unit.test_dataset import build_tokenizer, gsm_row, user, write_parquet


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def verl_rows() -> list[dict]:
    """verl's columns; extra_info keys differ between rows (tools_kwargs on one only), as in real data."""
    return [gsm_row("What is 2 + 3?", "5", 7), gsm_row("What is 12 + 3?", "15", 8),
            gsm_row("What is 2 + 3 + 4 + 5?", "14", None, tools_kwargs={"calc": {"create_kwargs": {"a": 1}}},
                    need_tools_kwargs=True)]


def write_json(path, rows) -> str:
    path.write_text(json.dumps(rows))
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def plain(row: dict) -> dict:
    return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in row.items()}


def test_json_and_jsonl_give_the_rows_of_the_parquet_of_the_same_data(tokenizer, tmp_path):
    rows = verl_rows()
    files = {"parquet": write_parquet(tmp_path / "d.parquet", rows), "json": write_json(tmp_path / "d.json", rows),
             "jsonl": write_jsonl(tmp_path / "d.jsonl", rows)}
    assert read_table(files["json"]).equals(read_table(files["parquet"]))
    assert read_table(files["jsonl"]).equals(read_table(files["parquet"]))
    kwargs = {"return_raw_chat": True, "return_full_prompt": True}
    expected = [plain(r) for r in PromptDataset(files["parquet"], tokenizer, **kwargs)]
    assert expected[2]["tools_kwargs"] == {"calc": {"create_kwargs": {"a": 1}}}
    for name in ("json", "jsonl"):
        assert [plain(r) for r in PromptDataset(files[name], tokenizer, **kwargs)] == expected, name
    mixed = PromptDataset([files["jsonl"], files["parquet"]], tokenizer)  # a mixed list, in file order
    assert [r["index"] for r in mixed] == [7, 8, 2, 7, 8, 5]
    assert mixed.data_sources() == ["openai/gsm8k"]


def test_a_json_file_may_hold_one_row_a_line_and_columns_are_the_union(tmp_path):
    path = write_jsonl(tmp_path / "rows.json", [{"prompt": "a"}, {"prompt": "b", "label": "2"}])
    assert read_columns(path) == ["prompt", "label"]
    assert read_table(path).to_pylist() == [{"prompt": "a", "label": None}, {"prompt": "b", "label": "2"}]


def test_slime_jsonl_loads_with_the_column_mapping(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "slime.jsonl", [
        {"prompt": "What is 2+3?", "label": 5, "metadata": {"split": "train", "index": 3}},
        {"prompt": "What is 12+3?", "label": 15, "metadata": None}])
    dataset = PromptDataset(path, tokenizer, label_key="label", data_source="addition", metadata_key="metadata",
                            return_raw_chat=True, return_full_prompt=True)
    first, second = dataset[0], dataset[1]
    assert first["full_prompts"] == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert first["input_ids"].tolist() == tokenizer.encode(first["full_prompts"], add_special_tokens=False)
    assert first["raw_prompt"] == user("What is 2+3?")
    assert first["reward_model"] == {"ground_truth": "5", "style": "rule"}  # a number as text, as slime reads it
    assert first["data_source"] == "addition" and first["extra_info"] == {"split": "train", "index": 3}
    assert first["index"] == 3 and second["index"] == 1 and second["extra_info"] is None
    assert dataset.data_sources() == ["addition"]
    batch = dataset.collate([first, second])
    assert list(batch["reward_model"]) == [{"ground_truth": "5", "style": "rule"},
                                           {"ground_truth": "15", "style": "rule"}]


def test_other_columns_name_the_prompt_truth_and_data_source(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": user("Q?"), "answer": "A", "source": "openai/gsm8k"}])
    dataset = PromptDataset(path, tokenizer, prompt_key="question", label_key="answer", data_source_key="source")
    assert dataset.data_sources() == ["openai/gsm8k"]
    row = dataset[0]
    assert row["data_source"] == "openai/gsm8k" and row["reward_model"]["ground_truth"] == "A"
    # verl's columns stay as they are when the file has them: data.data_source fills only files without one.
    verl = write_parquet(tmp_path / "verl.parquet", verl_rows())
    assert PromptDataset(verl, tokenizer, data_source="addition").data_sources() == ["openai/gsm8k"]


def test_bad_files_are_refused_naming_the_file_and_the_key(tokenizer, tmp_path):
    slime = write_jsonl(tmp_path / "slime.jsonl", [{"prompt": "What is 2+3?", "label": "5"}])
    with pytest.raises(ValueError, match=r"slime.jsonl: no column 'answer' \(data.label_key\); its columns are "
                                         r"\['prompt', 'label'\]"):
        PromptDataset(slime, tokenizer, label_key="answer", data_source="addition")
    with pytest.raises(ValueError, match=r"slime.jsonl: no column 'meta' \(data.metadata_key\)"):
        PromptDataset(slime, tokenizer, label_key="label", metadata_key="meta")
    with pytest.raises(ValueError, match=r"slime.jsonl: no column 'data_source' \(data.data_source_key"):
        PromptDataset(slime, tokenizer, label_key="label").data_sources()
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"rows.csv: prompt data files are .parquet, .json or .jsonl"):
        PromptDataset(str(csv), tokenizer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl line 2: not a JSON object"):
        PromptDataset(str(broken), tokenizer)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"prompt": user("b")}])
    with pytest.raises(ValueError, match=r"mixed.jsonl: column 'prompt' has values of different types"):
        PromptDataset(mixed, tokenizer)
    listed = write_json(tmp_path / "listed.json", [["not", "a", "row"]])
    with pytest.raises(ValueError, match=r"listed.json row 0: a row must be a JSON object"):
        PromptDataset(listed, tokenizer)


def _cfg(*overrides):
    return load_config(["recipe=tiny_cpu_grpo", *overrides])


def test_run_input_checks_read_every_format_and_the_mapping(tmp_path):
    slime = write_jsonl(tmp_path / "slime.jsonl", [{"prompt": "What is 2+3?", "label": "5", "meta": {}}])
    verl = write_json(tmp_path / "verl.json", verl_rows())
    mapped = ["data.label_key=label", "data.data_source=addition", "data.metadata_key=meta"]
    assert _check_data(_cfg(f"data.train_files=[{slime}]", f"data.val_files=[{slime}]", *mapped)) == [
        tmp_path / "slime.jsonl"]
    _check_data(_cfg(f"data.train_files=[{verl}]", f"data.val_files=[{verl}]"))
    with pytest.raises(ValueError, match=rf"data\.train_files: {slime} has no column\(s\) \['data_source', "
                                         rf"'reward_model'\], which pick each row's reward scorer and hold its "
                                         rf"ground truth; its columns are \['prompt', 'label', 'meta'\]"):
        _check_data(_cfg(f"data.train_files=[{slime}]"))
    with pytest.raises(ValueError, match=rf"data\.train_files: {slime} has no column 'extra' \(data\.metadata_key\)"):
        _check_data(_cfg(f"data.train_files=[{slime}]", f"data.val_files=[{slime}]", *mapped[:2],
                         "data.metadata_key=extra"))  # the train file is checked first
    with pytest.raises(ValueError, match=rf"data\.val_files: {slime} has no column\(s\) \['data_source', "):
        _check_data(_cfg(f"data.train_files=[{verl}]", f"data.val_files=[{slime}]"))  # one mapping for all files
    with pytest.raises(ValueError, match=rf"data\.train_files: {verl} has no column 'question' \(data\.prompt_key\)"
                                         rf" holding the chat messages; its columns are \['data_source', 'prompt'"):
        _check_data(_cfg(f"data.train_files=[{verl}]", "data.prompt_key=question"))
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(ValueError, match=rf"data\.train_files: {broken} is not a readable json file \("):
        _check_data(_cfg(f"data.train_files=[{broken}]"))
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt\n")
    with pytest.raises(ValueError, match=rf"data\.train_files: {csv}: prompt data files are \.parquet, \.json or"):
        _check_data(_cfg(f"data.train_files=[{csv}]"))


def test_the_settings_reach_the_dataset():
    cfg = _cfg("data.label_key=label", "data.data_source=addition", "data.metadata_key=meta",
               "data.data_source_key=source")
    kwargs = cfg.data.dataset_kwargs()
    assert (kwargs["label_key"], kwargs["data_source"], kwargs["metadata_key"], kwargs["data_source_key"]) == (
        "label", "addition", "meta", "source")
    defaults = _cfg().data.dataset_kwargs()
    assert (defaults["label_key"], defaults["data_source"], defaults["metadata_key"], defaults["data_source_key"]) \
        == (None, None, None, "data_source")


def test_the_tiny_warm_start_reads_json_rows_as_parquet_ones(tmp_path):
    from megarl.warmstart.sft import read_sft_rows

    rows = verl_rows()
    assert read_sft_rows([write_jsonl(tmp_path / "d.jsonl", rows)]) == read_sft_rows(
        [write_parquet(tmp_path / "d.parquet", rows)])


def test_plain_text_prompts_skip_the_chat_template_and_get_the_tokenizers_special_tokens(tmp_path):
    """slime without --apply-chat-template (a base model): the prompt string as it is, a BOS where the tokenizer
    adds one; the tokenizer needs no chat template."""
    from tokenizers import processors

    base = build_tokenizer(chat_template=None)
    base.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 256)])  # a BOS, as a base Llama's tokenizer
    path = write_jsonl(tmp_path / "raw.jsonl", [{"prompt": "Q: 2+3=? A:", "label": 5},
                                                {"prompt": "Q: 12+3=? A:", "label": 15}])
    dataset = PromptDataset(path, base, label_key="label", data_source="addition", apply_chat_template=False,
                            return_full_prompt=True, return_raw_chat=True, max_prompt_length=12)
    row = dataset[0]
    assert row["full_prompts"] == row["raw_prompt"] == "Q: 2+3=? A:"
    ids = row["input_ids"].tolist()
    assert ids == row["raw_prompt_ids"] and len(ids) == 12 and ids[0] == 256  # the BOS, then a byte a token
    assert base.decode(ids[1:]) == "Q: 2+3=? A:" and 256 not in ids[1:]
    # The length filter counts the same ids: 1 + 11 tokens fit 12, the second prompt's 1 + 12 do not.
    assert len(dataset) == 1 and [(p.row, p.num_tokens) for p in dataset.filtered_overlong] == [(1, 13)]
    with pytest.raises(ValueError, match=r"has no chat template"):  # the default still templates
        PromptDataset(path, base, label_key="label", data_source="addition")
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": user("Q?"), "label": 1}])
    with pytest.raises(ValueError, match=r"chat.jsonl row 0: the prompt is a list, but data.apply_chat_template="
                                         r"False takes plain-text prompts only; set data.apply_chat_template=True"):
        PromptDataset(chat, base, label_key="label", apply_chat_template=False)
    with pytest.raises(ValueError, match=r"data.apply_chat_template=False .* data.apply_chat_template_kwargs need"):
        PromptDataset(path, base, apply_chat_template=False, apply_chat_template_kwargs={"enable_thinking": False})


def test_plain_text_prompts_are_set_from_the_config_and_refused_with_multi_turn():
    assert _cfg().data.dataset_kwargs()["apply_chat_template"] is True
    assert _cfg("data.apply_chat_template=false").data.dataset_kwargs()["apply_chat_template"] is False
    with pytest.raises(ValueError, match=r"multi_turn.enable=True renders each turn with the chat template: set "
                                         r"data.apply_chat_template=True"):
        _cfg("data.apply_chat_template=false", "actor_rollout_ref.rollout.multi_turn.enable=true",
             "data.return_raw_chat=true")
