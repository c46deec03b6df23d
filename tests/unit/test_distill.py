"""On-policy distillation's signal, hand-computed, and the teacher's settings."""

import pytest
import torch

from megarl.algo import advantages
from megarl.algo.distill import apply_to_advantages, apply_to_rewards, distill_metrics, reverse_kl
from megarl.data import Batch

T = torch.tensor


def test_the_reverse_kl_and_where_it_enters():
    student = T([[-0.5, -1.0, -2.0], [-0.1, -0.2, -9.0]])
    teacher = T([[-1.0, -0.5, -2.0], [-0.3, -0.2, -1.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = reverse_kl(student, teacher, mask)
    torch.testing.assert_close(kl, T([[0.5, -0.5, 0.0], [0.2, 0.0, 0.0]]))  # nothing past a response's end
    metrics = distill_metrics(kl, mask)
    assert metrics["teacher/reverse_kl"] == pytest.approx(0.2 / 5)  # over the 5 response tokens
    assert metrics["teacher/reverse_kl_seq"] == pytest.approx((0.0 + 0.2) / 2)
    assert metrics["teacher/abs_log_ratio_max"] == pytest.approx(0.5)
    rewards = T([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(apply_to_rewards(rewards, kl, 2.0), T([[-1.0, 1.0, 1.0], [-0.4, 0.0, 0.0]]))
    adv = T([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    torch.testing.assert_close(apply_to_advantages(adv, kl, 2.0, mask), T([[0.0, 2.0, 1.0], [-1.4, -1.0, 0.0]]))


def test_with_no_task_reward_the_advantage_signal_is_the_negated_reverse_kl():
    """GRPO with every score 0 gives advantages 0; the ``advantage`` signal then leaves ``-coef · d_t`` per token:
    Thinking Machines' on-policy distillation (each token's advantage the negative reverse KL)."""
    batch = Batch(tensors={"token_level_rewards": torch.zeros(4, 3), "response_mask": torch.ones(4, 3)},
                  non_tensors={"uid": ["a", "a", "b", "b"]})
    advantages.compute("grpo", batch, gamma=1.0, lam=1.0)
    kl = torch.arange(12.0).reshape(4, 3) / 10
    out = apply_to_advantages(batch["advantages"], kl, 0.5, batch["response_mask"])
    torch.testing.assert_close(out, -0.5 * kl)


def test_the_teacher_settings_name_what_is_wrong():
    from megarl.config import load_config
    from megarl.plan.placement import placement_for

    base = ["recipe=tiny_cpu_grpo", "teacher.enable=true", "teacher.model.path=/models/teacher"]
    cfg = load_config(base + ["teacher.parallel.tp=2", "teacher.kl_coef=0.5", "teacher.signal=reward"])
    assert (cfg.teacher.kl_coef, cfg.teacher.signal, cfg.teacher.model.path) == (0.5, "reward", "/models/teacher")
    teacher = placement_for(cfg).role("teacher")
    assert (teacher.pool, teacher.bundles, teacher.dims.tp, teacher.dims.dp) == ("global", (0, 1), 2, 1)
    assert "teacher" not in placement_for(load_config(["recipe=tiny_cpu_grpo"])).roles
    with pytest.raises(ValueError, match=r"teacher.enable=true needs teacher.model.path"):
        load_config(["recipe=tiny_cpu_grpo", "teacher.enable=true"])
    with pytest.raises(ValueError, match=r"teacher.signal"):
        load_config(base + ["teacher.signal=loss"])
    with pytest.raises(ValueError, match=r"teacher.model.dtype"):
        load_config(base + ["teacher.model.dtype=int8"])
    with pytest.raises(ValueError, match=r"teacher.parallel.tp × teacher.parallel.pp × teacher.parallel.cp = 3"):
        load_config(base + ["teacher.parallel.tp=3"])
    with pytest.raises(ValueError, match=r"teacher.param_offload=True needs trainer.device=cuda"):
        load_config(base + ["teacher.param_offload=true"])


def test_a_teacher_of_another_tokenizer_is_refused_naming_both(tmp_path):
    """Distillation compares log-probs of the same token ids: a teacher whose tokenizer maps tokens to other ids is
    refused before Ray starts, naming both models; one of the student's tokenizer passes."""
    from megarl.config.model import ModelConfig, ScoringModelConfig
    from megarl.controller.run_inputs import check_same_tokenizer
    from megarl.models.tiny import build_tiny_tokenizer, save_tiny

    student = save_tiny(tmp_path / "student", num_layers=1)
    same = save_tiny(tmp_path / "same", num_layers=2, seed=5)
    other = save_tiny(tmp_path / "other", num_layers=1)
    build_tiny_tokenizer(vocab_size=400).save_pretrained(other)  # another BPE: ids differ
    check_same_tokenizer(ModelConfig(path=str(student)), ScoringModelConfig(path=str(same)))
    with pytest.raises(ValueError, match=rf"teacher.model.path='{other}' and the policy's "
                                         rf"actor_rollout_ref.model.path='{student}' have different tokenizers: "
                                         r"\d+ token\(s\) map to other ids"):
        check_same_tokenizer(ModelConfig(path=str(student)), ScoringModelConfig(path=str(other)))


def test_a_reward_models_scores_enter_on_each_responses_last_token():
    """``replace``: the reward model's score is the reward (verl's); ``add``: the rule reward plus ``rm_coef`` times it;
    either way on the response's last token (an empty response: the first position), as the rule score sits."""
    from megarl.controller.reward_sources import Signal, on_last_token
    from megarl.controller.reward_stage import combined

    rule = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    model = on_last_token(T([2.0, -1.0, 3.0]), mask, rule)
    torch.testing.assert_close(combined(rule, Signal(model), "replace"),
                               T([[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [3.0, 0.0, 0.0]]))
    torch.testing.assert_close(combined(rule, Signal(model, coef=0.5), "add"),
                               T([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [1.5, 0.0, 0.0]]))


def test_the_reward_model_settings_name_what_is_wrong():
    from megarl.config import load_config

    base = ["recipe=tiny_cpu_grpo", "reward_model.enable=true", "reward_model.model.path=/models/rm"]
    cfg = load_config(base + ["reward_model.combine=add", "reward_model.rm_coef=0.5", "reward_model.parallel.tp=2"])
    assert (cfg.reward_model.combine, cfg.reward_model.rm_coef, cfg.reward_model.parallel.tp) == ("add", 0.5, 2)
    with pytest.raises(ValueError, match=r"reward_model.enable=true needs reward_model.model.path"):
        load_config(["recipe=tiny_cpu_grpo", "reward_model.enable=true"])
    with pytest.raises(ValueError, match=r"reward_model.combine"):
        load_config(base + ["reward_model.combine=mean"])
    with pytest.raises(ValueError, match=r"reward_model.model.init='tiny_sft' is unknown; use one of "
                                         r"\['pretrained', 'tiny_rm'\]"):
        load_config(base + ["reward_model.model.init=tiny_sft"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.init='tiny_rm' is unknown"):
        load_config(base + ["actor_rollout_ref.model.init=tiny_rm"])
    with pytest.raises(ValueError, match=r"reward_model.model.rm_steps"):
        load_config(base + ["reward_model.model.rm_steps=0"])
    # A path given on the command line is a model to load, never a cache to (re)build.
    assert load_config(["recipe=tiny_cpu_rm_grpo", "reward_model.model.path=/models/rm"]).reward_model.model.init == \
        "pretrained"
    assert load_config(["recipe=tiny_cpu_rm_grpo"]).reward_model.model.init == "tiny_rm"
    with pytest.raises(ValueError, match=r"algorithm.filter_groups.enable=true keeps or drops groups by their rule "
                                         r"rewards"):
        load_config(base + ["algorithm.filter_groups.enable=true"])
    with pytest.raises(ValueError, match=r"reward_model.param_offload=True needs trainer.device=cuda"):
        load_config(base + ["reward_model.param_offload=true"])
