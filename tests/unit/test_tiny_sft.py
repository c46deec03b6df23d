"""The tiny recipe's warm start (megarl.warmstart.sft) and its data (megarl.warmstart.addition_data).

A model much smaller than the recipe's keeps every SFT here to a second or two.
"""

import json
import logging
import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from megarl.models.tiny import build_tiny_model, build_tiny_tokenizer
from megarl.warmstart import addition_data
from megarl.warmstart import sft as tiny_sft

SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(train, test) parquet files with 64 and 8 addition problems."""
    return addition_data.ensure_addition_data(tmp_path_factory.mktemp("addition"), num_train=64, num_test=8, seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def sft(path, train, **overrides):
    """ensure_tiny_sft with the small model and short-run defaults."""
    kwargs = {"steps": 4, "lr": 1e-3, "batch_size": 8, "model_sizes": SMALL, "num_threads": None,
              "progress": False, **overrides}
    return tiny_sft.ensure_tiny_sft(path, [train], **kwargs)


@pytest.fixture
def count_trainings(monkeypatch):
    """A list that gets one entry per train_sft call."""
    calls = []
    real = tiny_sft.train_sft

    def counting(*args, **kwargs):
        calls.append(kwargs["steps"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_sft, "train_sft", counting)
    return calls


# --------------------------------------------------------------------------------------- data


def test_ensure_addition_data_writes_once_then_reuses(tmp_path, caplog):
    train, test = addition_data.ensure_addition_data(tmp_path / "d", num_train=20, num_test=5, seed=4)
    rows = addition_data.make_addition_rows(20, 5, seed=4)
    assert pq.read_table(train).to_pylist() == rows["train"] and pq.read_table(test).to_pylist() == rows["test"]
    stamps = (train.stat().st_mtime_ns, test.stat().st_mtime_ns)
    assert addition_data.ensure_addition_data(tmp_path / "d", num_train=20, num_test=5, seed=4) == (train, test)
    assert (train.stat().st_mtime_ns, test.stat().st_mtime_ns) == stamps

    test.unlink()  # only the missing file is written again, with the same rows
    addition_data.ensure_addition_data(tmp_path / "d", num_train=20, num_test=5, seed=4)
    assert train.stat().st_mtime_ns == stamps[0] and pq.read_table(test).to_pylist() == rows["test"]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["test.parquet", "train.parquet"]  # no temp files

    with caplog.at_level(logging.WARNING, logger="megarl.warmstart.addition_data"):
        addition_data.ensure_addition_data(tmp_path / "d", num_train=30, num_test=5, seed=4)
    assert "already exists with 20 rows, not the 30 asked for" in caplog.text
    assert pq.read_table(train).num_rows == 20
    with pytest.raises(ValueError, match="num_test >= 1"):
        addition_data.ensure_addition_data(tmp_path / "e", num_train=20, num_test=0)


# ---------------------------------------------------------------------------------- training


def test_examples_train_only_on_the_answer_and_eos(data, tokenizer):
    rows = tiny_sft.read_sft_rows([data[0]])
    input_ids_NS, attention_mask_NS, labels_NS = tiny_sft.encode_sft_examples(rows[:3], tokenizer)
    assert rows[0].data_source == "addition" and rows[0].messages[0]["content"].startswith("What is ")
    for n, row in enumerate(rows[:3]):
        prompt = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        target = tokenizer.encode(row.answer + "<|im_end|>", add_special_tokens=False)
        assert len(target) == len(row.answer) + 1  # one token per digit, then EOS
        length = int(attention_mask_NS[n].sum())
        assert input_ids_NS[n, :length].tolist() == list(prompt) + target
        assert labels_NS[n, :length].tolist() == [-100] * len(prompt) + target
        assert (labels_NS[n, length:] == -100).all()


def test_short_sft_lowers_the_answer_loss(data, tokenizer):
    model = build_tiny_model(tokenizer, seed=0, **SMALL)
    examples = tiny_sft.encode_sft_examples(tiny_sft.read_sft_rows([data[0]]), tokenizer)
    losses = tiny_sft.train_sft(model, examples, steps=40, lr=1e-2, batch_size=16, seed=0, progress=False).losses
    assert len(losses) == 40
    # Measured: 5.98 (about ln 446, a uniform guess over the vocabulary) -> 1.79 over the last 10 steps.
    assert losses[0] > 5.5
    assert sum(losses[-10:]) / 10 < 2.2


def test_warm_start_is_saved_reused_and_deterministic(tmp_path, data, count_trainings):
    path = sft(tmp_path / "model", data[0])
    assert path == tmp_path / "model" and count_trainings == [4]
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", tiny_sft.MARKER_NAME} <= names
    marker = json.loads((path / tiny_sft.MARKER_NAME).read_text())
    assert marker["settings"]["steps"] == 4 and marker["settings"]["model_sizes"] == dict(sorted(SMALL.items()))
    assert marker["settings"]["num_examples"] == 64 and marker["final_loss"] < marker["first_loss"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.lock"]  # no temporary siblings

    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert sft(tmp_path / "model", data[0]) == path
    assert count_trainings == [4] and (path / "model.safetensors").stat().st_mtime_ns == stamp

    other = sft(tmp_path / "again", data[0])  # same seed and settings: the same weights
    first, second = load_file(path / "model.safetensors"), load_file(other / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("change", ["steps", "lr", "batch_size", "seed", "stop_reward", "data"])
def test_changed_settings_or_data_retrain(tmp_path, data, count_trainings, change):
    path = sft(tmp_path / "model", data[0])
    overrides = {"steps": {"steps": 5}, "lr": {"lr": 2e-3}, "batch_size": {"batch_size": 4},
                 "seed": {"seed": 1}, "stop_reward": {"stop_reward": 1.0}, "data": {}}[change]
    train = data[0]
    if change == "data":  # the same problems but one answer changed
        rows = pq.read_table(data[0]).to_pylist()
        rows[3]["reward_model"]["ground_truth"] = "0"
        train = tmp_path / "changed.parquet"
        pq.write_table(pa.Table.from_pylist(rows), train)
    sft(tmp_path / "model", train, **overrides)
    assert len(count_trainings) == 2
    assert sft(tmp_path / "model", train, **overrides) == path and len(count_trainings) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".", "model"))) == ["model", "model.lock"]


def test_failed_training_leaves_no_directory(tmp_path, data, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-training")

    monkeypatch.setattr(tiny_sft, "train_sft", crash)
    with pytest.raises(RuntimeError, match="killed mid-training"):
        sft(tmp_path / "model", data[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.lock"]
    monkeypatch.undo()

    path = sft(tmp_path / "model", data[0])  # an outdated warm start survives a failed retraining
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(tiny_sft, "train_sft", crash)
    with pytest.raises(RuntimeError):
        sft(tmp_path / "model", data[0], steps=6)
    assert tiny_sft.read_marker(path)["settings"]["steps"] == 4
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.lock"]


def test_concurrent_callers_train_once(tmp_path, data, count_trainings):
    # flock locks belong to open file descriptions, so two threads exclude each other like two processes.
    results, errors = [], []

    def call():
        try:
            results.append(sft(tmp_path / "model", data[0], steps=30))
        except BaseException as err:  # surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and results == [tmp_path / "model"] * 2 and count_trainings == [30]


def test_refuses_to_overwrite_a_directory_that_is_not_a_warm_start(tmp_path, data):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model.path=.*not a tiny_sft warm start"):
        sft(tmp_path / "model", data[0])
    assert os.listdir(tmp_path / "model") == ["config.json"]
    with pytest.raises(ValueError, match="model.sft_steps >= 1"):
        sft(tmp_path / "other", data[0], steps=0)


def test_training_stops_once_the_sampled_reward_reaches_the_target(tmp_path, data, monkeypatch, count_trainings):
    measured = []

    def fake_probe(model, tokenizer, rows, *, seed, processor=None):
        assert len(rows) == 64 and seed == 0  # every training row (fewer than NUM_PROBE_ROWS)

        def probe(step):
            measured.append(step)
            return {2: 0.1, 4: 0.3, 6: 0.45}.get(step, 0.0)

        return probe

    monkeypatch.setattr(tiny_sft, "CHECK_EVERY", 2)
    monkeypatch.setattr(tiny_sft, "reward_probe", fake_probe)
    path = sft(tmp_path / "model", data[0], steps=20, stop_reward=0.4)
    marker = tiny_sft.read_marker(path)
    assert measured == [2, 4, 6] and marker["steps_taken"] == 6
    assert marker["rewards"] == [[2, 0.1], [4, 0.3], [6, 0.45]] and marker["settings"]["stop_reward"] == 0.4

    measured.clear()  # never reached: all steps run, with a warning
    sft(tmp_path / "other", data[0], steps=8, stop_reward=0.9)
    assert measured == [2, 4, 6, 8] and tiny_sft.read_marker(tmp_path / "other")["steps_taken"] == 8
    with pytest.raises(ValueError, match=r"model.sft_stop_reward must be in \(0, 1\]"):
        sft(tmp_path / "third", data[0], stop_reward=1.5)


@pytest.fixture(scope="module")
def answer_42(data, tmp_path_factory):
    """The train problems, all with ground truth "42": a task the small model learns in a few steps."""
    rows = pq.read_table(data[0]).to_pylist()
    for row in rows:
        row["reward_model"]["ground_truth"] = "42"
    path = tmp_path_factory.mktemp("answer_42") / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_reward_probe_samples_the_model_as_it_trains(tmp_path, answer_42, tokenizer, monkeypatch):
    model = build_tiny_model(tokenizer, seed=0, **SMALL)
    rows = tiny_sft.read_sft_rows([answer_42])
    probe = tiny_sft.reward_probe(model, tokenizer, rows[:16], seed=0)
    assert probe(1) == probe(1) == 0.0 and model.training  # reproducible; leaves the model in training mode
    examples = tiny_sft.encode_sft_examples(rows, tokenizer)
    tiny_sft.train_sft(model, examples, steps=50, lr=1e-2, batch_size=16, seed=0, progress=False)
    assert probe(2) >= 0.9  # measured 1.0 (0.875 after 30 steps)

    # With the real probe: stops at the first check at or above the target, long before all steps.
    monkeypatch.setattr(tiny_sft, "CHECK_EVERY", 5)
    marker = tiny_sft.read_marker(sft(tmp_path / "model", answer_42, steps=200, lr=1e-2, batch_size=16,
                                      stop_reward=0.9))
    assert marker["steps_taken"] < 60 and marker["rewards"][-1][1] >= 0.9
    assert all(reward < 0.9 for _, reward in marker["rewards"][:-1])


# ---------------------------------------------------------------------------------- accuracy


def test_accuracy_scores_responses_like_the_reward(tmp_path, data, monkeypatch):
    path = sft(tmp_path / "model", data[0])
    untrained = tiny_sft.tiny_sft_accuracy(path, data[1], num=8, temperature=1.0, seed=3)
    assert 0.0 <= untrained <= 0.25 and untrained == tiny_sft.tiny_sft_accuracy(path, data[1], num=8,
                                                                                   temperature=1.0, seed=3)
    answers = [row["reward_model"]["ground_truth"] for row in pq.read_table(data[1]).to_pylist()]
    tokenizer = build_tiny_tokenizer()

    def answer_right_for_even_rows(model, tok, prompt_ids, *, temperature, seed, max_new_tokens, vision=None):
        assert temperature == 0.0 and len(prompt_ids) == 8
        texts = [answers[i] if i % 2 == 0 else "12" for i in range(len(prompt_ids))]
        return [tokenizer.encode(t + "<|im_end|>", add_special_tokens=False) for t in texts]

    monkeypatch.setattr(tiny_sft, "sample_responses", answer_right_for_even_rows)
    assert tiny_sft.tiny_sft_accuracy(path, data[1], num=8) == 0.5


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_warm_start_samples_what_the_hf_engine_samples(data, tokenizer, temperature):
    """The warm start's sampler (models.sampling.generate, below the rollout layer) returns the HF engine's
    tokens bit for bit: both run models.sampling.sample_continuations, and this checks that generate feeds
    it the engine's row seeds, padding and stop ids. The SFT stop check, and with it the cached model,
    depends on it."""
    from megarl.engines.cpu_engine.hf_engine import HFEngine
    from megarl.engines.engine import SamplingParams

    model = build_tiny_model(tokenizer, seed=0, **SMALL)
    rows = tiny_sft.read_sft_rows([data[0]])
    examples = tiny_sft.encode_sft_examples(rows, tokenizer)
    tiny_sft.train_sft(model, examples, steps=30, lr=1e-2, batch_size=16, seed=0, progress=False)
    prompt_ids = tiny_sft.encode_prompt_ids(rows, tokenizer)
    prompt_ids[5] = prompt_ids[5][3:]  # rows of different lengths: left padding
    for seed in (0, 11):
        own = tiny_sft.sample_responses(model, tokenizer, prompt_ids, temperature=temperature, seed=seed)
        engine = HFEngine(model, tokenizer).generate(
            prompt_ids, SamplingParams(max_new_tokens=tiny_sft.MAX_NEW_TOKENS, temperature=temperature, seed=seed))
        assert own == [output.output_ids for output in engine]
    assert any(len(r) < tiny_sft.MAX_NEW_TOKENS for r in own)  # rows that stop early are compared too
    assert temperature == 0 or len({tuple(r) for r in own}) > 1


# ------------------------------------------------------------------------------------ config


def test_the_tiny_recipe_stops_its_warm_start_at_a_third_of_the_reward():
    from megarl.config import ConfigError, load_config

    model = load_config(["recipe=tiny_cpu_grpo"]).actor_rollout_ref.model  # megarl-train's default
    assert (model.init, model.sft_steps, model.sft_lr, model.sft_stop_reward) == ("tiny_sft", 800, 2e-3, 0.3)
    assert load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.sft_stop_reward=null"]).actor_rollout_ref.model.sft_stop_reward is None
    with pytest.raises((ConfigError, ValueError), match=r"actor_rollout_ref.model.sft_stop_reward=1.5 must be in"):
        load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.sft_stop_reward=1.5"])


def test_training_files_without_the_warm_start_columns_are_named(tmp_path):
    path = tmp_path / "questions.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1 + 1", "data_source": "x"}]), path)
    with pytest.raises(ValueError, match=rf"{path}: no column\(s\) \['prompt', 'reward_model'\]; the tiny_sft warm "
                                         rf"start reads \['data_source', 'prompt', 'reward_model'\]"):
        tiny_sft.read_sft_rows([path])
