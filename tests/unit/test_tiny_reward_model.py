"""The tiny reward-model recipe's reward model (megarl.warmstart.reward_model, ``reward_model.model.init=tiny_rm``)
and how a step's reward-model scores are compared with the rule rewards (megarl.controller.reward_sources).

A model much smaller than the recipe's keeps each build here to seconds; the recipe's own figures (held-out accuracy
0.90, AUC 0.93) are in the module's docstring.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megarl.warmstart import addition_data
from megarl.warmstart import reward_model as tiny_rm
from megarl.warmstart import sft as tiny_sft

SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(train, test) parquet files with 200 and 8 addition problems."""
    return addition_data.ensure_addition_data(tmp_path_factory.mktemp("addition"), num_train=200, num_test=8, seed=0)


@pytest.fixture(scope="module")
def policy(data, tmp_path_factory):
    """A small SFT warm start: the policy whose samples the reward model learns to score."""
    return tiny_sft.ensure_tiny_sft(tmp_path_factory.mktemp("policy") / "sft", [data[0]], steps=20, lr=3e-3,
                                    batch_size=32, model_sizes=SMALL, num_threads=None, progress=False)


def build(path, data, policy, **overrides):
    kwargs = {"base": policy, "steps": 12, "lr": 1e-3, "batch_size": 32, "num_prompts": 48, "samples_per_prompt": 1,
              "near_misses": 1, "num_threads": None, **overrides}
    return tiny_rm.ensure_tiny_reward_model(path, [data[0]], **kwargs)


def test_a_sequence_classifier_of_the_policys_tokenizer_with_its_held_out_figures(tmp_path, data, policy):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    path = build(tmp_path / "rm", data, policy)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["Qwen2ForSequenceClassification"] and config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id  # the last token is read
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(policy).get_vocab()
    figures = tiny_rm.tiny_rm_figures(path)
    # 48 prompts x (1 sample + the ground truth + 1 near miss); held out: 128 prompts the same way.
    assert figures["examples"] == 48 * 3
    assert all(math.isfinite(figures[k]) for k in ("accuracy", "auc", "first_loss", "final_loss"))
    assert 0 < figures["positive_share"] < 1
    model = AutoModelForSequenceClassification.from_pretrained(path)
    ids = torch.tensor([tokenizer.encode("1+1=2")])
    assert model(input_ids=ids).logits.shape == (1, 1)


def test_built_once_then_reused_and_rebuilt_when_its_settings_change(tmp_path, data, policy, monkeypatch):
    calls = []
    real = tiny_rm._build
    monkeypatch.setattr(tiny_rm, "_build", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    path = build(tmp_path / "rm", data, policy)
    marker = json.loads((path / tiny_rm.MARKER_NAME).read_text())
    assert build(tmp_path / "rm", data, policy) == path and len(calls) == 1
    build(tmp_path / "rm", data, policy, lr=2e-3)
    assert len(calls) == 2 and json.loads((path / tiny_rm.MARKER_NAME).read_text())["settings"]["lr"] == 2e-3
    assert marker["settings"]["base"]["settings"]["steps"] == 20  # the policy's own marker: a new policy rebuilds


def test_refuses_what_it_did_not_build_and_too_few_rows(tmp_path, data, policy):
    other = tmp_path / "real_model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"reward_model.model.path=.*real_model is not a tiny_rm reward model"):
        build(other, data, policy)
    with pytest.raises(ValueError, match=r"trains on 150 prompts and measures on 128 more; data.train_files has 200"):
        build(tmp_path / "rm", data, policy, num_prompts=150)


def test_labels_are_the_rule_rewards_of_samples_ground_truths_and_near_misses(data, policy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.reward.registry import default_compute_score

    rows = tiny_sft.read_sft_rows([data[0]])[:6]
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    sequences, labels = tiny_rm.labelled_samples(model, tokenizer, rows, samples=2, near=3, seed=0)
    assert len(sequences) == len(labels) == 6 * (2 + 1 + 3)
    prompts = tiny_sft.encode_prompt_ids(rows, tokenizer)
    # After the samples: each row's ground truth (1), then its near misses (0: off by 1 to 10).
    for n, row in enumerate(rows):
        start = 12 + 4 * n
        assert labels[start:start + 4] == [1.0, 0.0, 0.0, 0.0]
        for sequence in sequences[start + 1:start + 4]:
            answer = tokenizer.decode(sequence[len(prompts[n]):], skip_special_tokens=True)
            assert 1 <= abs(int(answer) - int(row.answer)) <= 10
    for n in range(12):  # the samples: labelled by the rule, as the trainer scores them
        row, prompt = rows[n % 6], prompts[n % 6]
        result = default_compute_score(row.data_source, tokenizer.decode(sequences[n][len(prompt):],
                                                                         skip_special_tokens=True), row.answer, {})
        assert labels[n] == float(result["score"] if isinstance(result, dict) else result)
    assert tiny_rm.near_misses("not a number", 3, torch.Generator()) == []


def test_auc_and_the_rule_agreement_metrics():
    from megarl.controller.reward_sources import rule_agreement

    assert tiny_rm.auc(torch.tensor([3.0, 2.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])) == 1.0
    assert tiny_rm.auc(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])) == 0.0
    assert tiny_rm.auc(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == 0.5
    assert math.isnan(tiny_rm.auc(torch.tensor([1.0]), torch.tensor([1.0])))
    rule, score = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([[2.0], [-1.0], [1.5], [0.5]])
    got = rule_agreement(rule, score)
    assert got["reward_model/rule_score/mean"] == 0.5
    assert got["reward_model/rule_corr"] == pytest.approx(float(torch.corrcoef(torch.stack([rule, score[:, 0]]))[0, 1]))
    assert got["reward_model/rule_corr"] > 0.8
    assert "reward_model/rule_corr" not in rule_agreement(torch.ones(4), score)  # the rule does not vary
