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
    prepare_policy(_cfg(tmp_path, f"{ARR}.model.tokenizer_path={tokenizer}"))  # complete: accepted
    with pytest.raises(ValueError, match=rf"{ARR}\.model\.path=.* is not a directory"):
        prepare_policy(_cfg(tmp_path / "nothing"))


def test_a_complete_model_directory_passes(tmp_path):
    from megarl.models.tiny import save_tiny

    prepare_policy(_cfg(save_tiny(tmp_path / "model", num_layers=1)))
