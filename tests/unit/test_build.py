"""Run set-up before Ray: the policy's directory is checked, naming the key and what is missing (issue 12, item 3)."""

from __future__ import annotations

import pytest

from megarl.config import load_config
from megarl.controller.build import prepare_policy

ARR = "actor_rollout_ref"


def _cfg(path, *extra):
    return load_config([f"{ARR}.model.init=pretrained", f"{ARR}.model.path={path}", *extra])


def test_an_empty_model_directory_names_the_key_and_the_missing_files(tmp_path):
    with pytest.raises(ValueError, match=rf"{ARR}\.model\.path=.* has no config / weights / tokenizer "
                                         r"\(config: one of config\.json; weights: one of \*\.safetensors"):
        prepare_policy(_cfg(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{ARR}\.model\.path=.* has no tokenizer \(tokenizer: one of tokenizer\.json"):
        prepare_policy(_cfg(tmp_path))
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    with pytest.raises(ValueError, match=rf"{ARR}\.model\.tokenizer_path=.* has no tokenizer"):
        prepare_policy(_cfg(tmp_path, f"{ARR}.model.tokenizer_path={tokenizer}"))
    (tokenizer / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"data\.train_files"):  # the model passes; the data comes next
        prepare_policy(_cfg(tmp_path, f"{ARR}.model.tokenizer_path={tokenizer}", "data.train_files=[none.parquet]"))
    with pytest.raises(ValueError, match=rf"{ARR}\.model\.path=.* is not a directory"):
        prepare_policy(_cfg(tmp_path / "nothing"))


def test_a_complete_model_directory_passes(tmp_path, monkeypatch):
    from megarl.models.tiny import save_tiny

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "addition").mkdir(parents=True)
    for name in ("train.parquet", "test.parquet"):  # the recipe's data files: present
        (tmp_path / "data" / "addition" / name).write_bytes(b"")
    prepare_policy(_cfg(save_tiny(tmp_path / "model", num_layers=1)))


def test_missing_data_is_refused_and_never_filled_in_except_at_the_tiny_recipe_paths(tmp_path, monkeypatch):
    """Issue 12: the tiny recipe's generator used to write addition problems wherever data.train_files pointed."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"data\.train_files: data/addtion/train\.parquet does not exist"):
        prepare_policy(load_config(["data.train_files=[data/addtion/train.parquet]"]))  # the tiny recipe, a typo
    assert not (tmp_path / "data").exists()  # nothing written, neither at the typo nor at the default
    from megarl.models.tiny import save_tiny

    model = save_tiny(tmp_path / "model", num_layers=1)
    (tmp_path / "train.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"data\.val_files: .*missing\.parquet does not exist"):
        prepare_policy(_cfg(model, f"data.train_files=[{tmp_path / 'train.parquet'}]",
                            f"data.val_files=[{tmp_path / 'missing.parquet'}]"))


def test_inputs_outside_the_config_are_checked_before_placement(tmp_path, monkeypatch):
    from megarl.controller.build import check_run_inputs

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match=r"trainer\.device=cuda but this machine has no usable CUDA GPU"):
        check_run_inputs(load_config(["recipe=qwen2_5_7b_grpo"]))  # no GPU here
    cfg = load_config([f"{ARR}.rollout.multi_turn.enable=true", "data.return_raw_chat=true",
                       f"{ARR}.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}"])
    with pytest.raises(ValueError, match=rf"{ARR}\.rollout\.multi_turn\.tool_config_path=.*tools\.yaml' does not exist"):
        check_run_inputs(cfg)
    check_run_inputs(load_config())  # the tiny recipe: nothing outside the config is missing
