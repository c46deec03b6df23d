"""The run config: every recipe composes and validates; overrides; errors name the key; defaults in dataclasses."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from omegaconf import OmegaConf

from megarl.algo.losses import policy_loss
from megarl.config import (
    CONFIG_DIR,
    SCHEMA_NAME,
    ActorConfig,
    ConfigError,
    DataConfig,
    OptimConfig,
    ParallelDims,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    data_parallel_size,
    to_run_config,
    validate,
)
from megarl.config import compose_config as _compose_config
from megarl.config import load_config as _load_config

TINY = "recipe=tiny_cpu_grpo"
"""The config these tests vary (megarl-train's default; the base config, a GPU run, names no model or data); a
``recipe=`` override after it wins."""


def load_config(overrides=()):
    return _load_config([TINY, *overrides])


def compose_config(overrides=()):
    return _compose_config([TINY, *overrides])


RECIPES = sorted(path.stem for path in (CONFIG_DIR / "recipe").glob("*.yaml"))
ARR = "actor_rollout_ref"


def test_the_issue_recipes_exist():
    assert set(RECIPES) >= {"tiny_cpu_grpo", "qwen2_5_0_5b_grpo", "qwen2_5_7b_grpo", "qwen2_5_7b_ppo",
                            "llama3_1_70b_grpo"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    cfg = load_config([f"recipe={recipe}"])
    assert isinstance(cfg, RunConfig)
    assert cfg.recipe == recipe
    actor = cfg.actor_rollout_ref.actor
    assert isinstance(actor.parallel, ParallelDims)  # the schema's section is the layout the workers use
    dims = actor.parallel.for_world(cfg.trainer.world_size)
    assert dims.world_size == cfg.trainer.world_size
    assert data_parallel_size(cfg, actor.parallel) == dims.dp
    assert isinstance(actor.optim, OptimConfig)
    assert isinstance(cfg.actor_rollout_ref.rollout, RolloutConfig)
    prompt_length, response_length = cfg.rollout_widths()
    assert prompt_length >= cfg.data.max_prompt_length and response_length == cfg.data.max_response_length


def test_load_config_validates_once(monkeypatch):
    """``load_config`` runs the cross-component checks; nothing after it (the pre-flight) repeats them."""
    import megarl.config.loading as loading
    from megarl.plan.preflight import plan_run

    calls = []
    monkeypatch.setattr(loading, "validate", lambda cfg, **kwargs: calls.append(cfg))
    cfg = load_config(["recipe=qwen2_5_7b_grpo"])
    assert len(calls) == 1
    plan_run(cfg, check=False)
    assert len(calls) == 1


def test_recipe_layouts():
    tiny = load_config()
    assert tiny.recipe == "tiny_cpu_grpo"  # megarl-train's default
    assert (tiny.trainer.device, tiny.trainer.world_size, tiny.actor_rollout_ref.actor.parallel.tp) == ("cpu", 2, 2)
    assert tiny.actor_rollout_ref.rollout.name == "hf" and tiny.needs_ref
    assert tiny.actor_rollout_ref.model.init == "tiny_sft"
    ppo = load_config(["recipe=qwen2_5_7b_ppo"])
    assert ppo.critic.enable and ppo.algorithm.adv_estimator == "gae"
    big = load_config(["recipe=llama3_1_70b_grpo"])
    parallel = big.actor_rollout_ref.actor.parallel
    assert big.trainer.world_size == 64 and (parallel.tp, parallel.pp, parallel.vpp) == (8, 4, 5)
    assert data_parallel_size(big, parallel) == 2


def test_override_reaches_the_typed_config():
    cfg = load_config(["trainer.total_steps=10", f"{ARR}.rollout.n=4", "recipe=qwen2_5_7b_grpo"])
    assert cfg.trainer.total_steps == 10
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.recipe == "qwen2_5_7b_grpo"


def test_yaml_lists_coerce_to_typed_fields():
    cfg = load_config([f"{ARR}.actor.optim.betas=[0.9,0.95]", "trainer.logger=[console]"])
    assert tuple(cfg.actor_rollout_ref.actor.optim.betas) == (0.9, 0.95)
    assert cfg.trainer.logger == ["console"]


@pytest.mark.parametrize("override, key", [
    ("trainer.total_stepz=10", "trainer.total_stepz"),
    ("+trainer.total_stepz=10", "trainer.total_stepz"),
    ("trainer.total_steps=ten", "trainer.total_steps"),
    (f"{ARR}.rollout.multi_turn.enable=maybe", f"{ARR}.rollout.multi_turn.enable"),
    ("recipe=no_such_recipe", "recipe"),
])
def test_broken_override_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([override])


@pytest.mark.parametrize("override, key", [
    (f"{ARR}.rollout.n=0", f"{ARR}.rollout"),
    (f"{ARR}.actor.parallel.tp=0", f"{ARR}.actor.parallel"),
    (f"{ARR}.actor.loss_agg_mode=mean", f"{ARR}.actor.loss_agg_mode"),
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator"),
    ("trainer.device=tpu", "trainer.device"),
    (f"{ARR}.actor.optim.lr=0", f"{ARR}.actor.optim"),
    (f"{ARR}.actor.router_replay.mode=R3", f"{ARR}.actor.router_replay.mode"),
    (f"{ARR}.model.tiny_arch=gpt2", f"{ARR}.model.tiny_arch"),
])
def test_section_check_names_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config([override])


def test_defaults_come_from_the_dataclasses_without_yaml():
    schema = OmegaConf.structured(RunConfig)
    assert schema.trainer.save_freq == -1
    assert schema.actor_rollout_ref.actor.optim.lr == OptimConfig().lr
    assert schema.actor_rollout_ref.actor.parallel.tp == ParallelDims().tp
    assert schema.actor_rollout_ref.rollout.n == RolloutConfig().n
    assert OmegaConf.is_missing(schema.data, "train_files")  # the one thing a recipe must say
    assert TrainerConfig().world_size == 8
    bare = OmegaConf.to_object(OmegaConf.merge(schema, {"data": {"train_files": ["x.parquet"]},
                                                        ARR: {"model": {"path": "m"}}}))
    with pytest.raises(ValueError, match=r"adv_estimator=grpo compares the samples .*rollout\.n=1:"):
        validate(bare)  # verl's n=1 under the default estimator, GRPO: a group size is the one more thing to say
    cfg = OmegaConf.to_object(OmegaConf.merge(schema, {"data": {"train_files": ["x.parquet"]},
                                                       ARR: {"model": {"path": "m"}, "rollout": {"n": 8}}}))
    validate(cfg)  # then the defaults form a consistent (1 node x 8 GPU) run


def test_schema_is_registered_and_yaml_holds_no_defaults():
    from hydra.core.config_store import ConfigStore

    from megarl.config import register_schema

    register_schema()
    assert f"{SCHEMA_NAME}.yaml" in ConfigStore.instance().list("")
    top = OmegaConf.load(CONFIG_DIR / "config.yaml")
    assert set(top) == {"defaults"} and top.defaults[0] == SCHEMA_NAME


def test_dataset_kwargs_are_prompt_dataset_keywords():
    import inspect

    from megarl.data.dataset import PromptDataset

    kwargs = load_config().data.dataset_kwargs()
    assert set(kwargs) <= set(inspect.signature(PromptDataset).parameters)


def _cfg(*overrides: str) -> RunConfig:
    return load_config(list(overrides))


# Each cross-component rule: a failing case, with the key the message must name.
RULE_CASES = [
    # world size
    ("world_tp", ["trainer.n_cpu_ranks=3"], f"{ARR}.actor.parallel.tp"),
    ("world_dp", [f"{ARR}.actor.parallel.dp=2"], f"{ARR}.actor.parallel.dp=2"),
    ("world_cp", [f"{ARR}.actor.parallel.cp=2"], f"{ARR}.actor.parallel.tp/pp/cp"),
    ("world_nodes_cpu", ["trainer.nnodes=2"], "trainer.nnodes"),
    ("world_critic", ["recipe=qwen2_5_7b_ppo", "critic.parallel.tp=3"], "critic.parallel.tp"),
    ("world_critic_sp", ["recipe=qwen2_5_7b_ppo", "critic.parallel.sequence_parallel=true"],
     "critic.parallel.sequence_parallel"),
    # batches
    ("batch_world", ["trainer.n_cpu_ranks=4", f"{ARR}.actor.parallel.tp=1", "data.train_batch_size=3",
                     f"{ARR}.rollout.n=1", f"{ARR}.actor.ppo_mini_batch_size=1"], "data.train_batch_size"),
    ("batch_mini_divides_train", [f"{ARR}.actor.ppo_mini_batch_size=6"], f"{ARR}.actor.ppo_mini_batch_size=6"),
    ("batch_mini_over_dp", ["recipe=qwen2_5_0_5b_grpo", f"{ARR}.rollout.n=1", f"{ARR}.actor.ppo_mini_batch_size=4"],
     f"{ARR}.actor.ppo_mini_batch_size"),
    ("batch_micro", [f"{ARR}.actor.ppo_micro_batch_size_per_gpu=5"], f"{ARR}.actor.ppo_micro_batch_size_per_gpu=5"),
    ("batch_vpp", ["recipe=llama3_1_70b_grpo", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=128"],
     f"{ARR}.actor.parallel.vpp"),
    ("batch_critic_micro", ["recipe=qwen2_5_7b_ppo", "critic.ppo_micro_batch_size_per_gpu=48"],
     "critic.ppo_micro_batch_size_per_gpu"),
    # engines
    ("engine_sglang_cpu", [f"{ARR}.rollout.name=sglang"], f"{ARR}.rollout.name"),
    ("engine_hf_tp", [f"{ARR}.rollout.tensor_model_parallel_size=2"], f"{ARR}.rollout.tensor_model_parallel_size"),
    ("engine_tp_divides", ["recipe=qwen2_5_7b_grpo", f"{ARR}.rollout.tensor_model_parallel_size=3"],
     f"{ARR}.rollout.tensor_model_parallel_size=3"),
    ("engine_tp_node", ["recipe=qwen2_5_7b_grpo", "trainer.nnodes=3", "trainer.n_gpus_per_node=4",
                        f"{ARR}.actor.parallel.tp=2", f"{ARR}.rollout.tensor_model_parallel_size=6",
                        "data.train_batch_size=96", f"{ARR}.actor.ppo_mini_batch_size=24"],
     "exceeds trainer.n_gpus_per_node=4 without being a multiple"),
    ("engine_pool_spans_unequal_nodes", ["recipe=qwen2_5_7b_grpo", f"{ARR}.hybrid_engine=false",
                                         f"{ARR}.rollout.pool_nodes=[8,4]",
                                         f"{ARR}.rollout.tensor_model_parallel_size=8"],
     f"{ARR}.rollout.tensor_model_parallel_size=8 neither divides"),
    ("engine_prompt_len", [f"{ARR}.rollout.prompt_length=8"], f"{ARR}.rollout.prompt_length"),
    ("engine_response_len", [f"{ARR}.rollout.response_length=8"], f"{ARR}.rollout.response_length"),
    ("engine_max_model_len", [f"{ARR}.rollout.max_model_len=64"], f"{ARR}.rollout.max_model_len"),
    ("engine_disaggregated_pool", [f"{ARR}.hybrid_engine=false"], f"{ARR}.rollout.pool_nodes"),
    ("engine_tensor_transport_colocated", [f"{ARR}.hybrid_engine=false", f"{ARR}.rollout.pool_nodes=[2]",
                                           f"{ARR}.rollout.weight_transport=tensor"], f"{ARR}.rollout.weight_transport"),
    ("engine_pool_needs_disaggregated", [f"{ARR}.rollout.pool_nodes=[2]"], f"{ARR}.hybrid_engine"),
    ("engine_pool_tp", ["recipe=qwen2_5_7b_grpo", f"{ARR}.hybrid_engine=false", f"{ARR}.rollout.pool_nodes=[6]",
                        f"{ARR}.rollout.tensor_model_parallel_size=4"], f"{ARR}.rollout.tensor_model_parallel_size=4"),
    # memory flags
    ("memory_offload_cpu", [f"{ARR}.actor.optimizer_offload=true"], f"{ARR}.actor.optimizer_offload"),
    ("memory_ref_offload_cpu", [f"{ARR}.ref.param_offload=true"], f"{ARR}.ref.param_offload"),
    # algorithm and roles
    ("algo_gae_needs_critic", ["algorithm.adv_estimator=gae"], "critic.enable"),
    ("algo_critic_unused", ["critic.enable=true"], "critic.enable"),
    ("algo_warmup", ["trainer.critic_warmup=2"], "trainer.critic_warmup"),
    ("algo_multi_turn_raw_chat", [f"{ARR}.rollout.multi_turn.enable=true"], "data.return_raw_chat"),
    ("algo_kl_coef", [f"{ARR}.actor.kl_loss_coef=0"], f"{ARR}.actor.kl_loss_coef"),
    ("algo_tis", [f"{ARR}.actor.tis_cap=2.0", f"{ARR}.rollout.calculate_log_probs=false"], f"{ARR}.actor.tis_cap"),
    ("algo_router_replay_multi_turn", [f"{ARR}.actor.router_replay.mode=replay", f"{ARR}.rollout.multi_turn.enable=true",
                                       "data.return_raw_chat=true"], f"{ARR}.actor.router_replay.mode=replay"),
    # asynchronous training
    ("async_colocated", ["trainer.mode=fully_async"], f"{ARR}.hybrid_engine=false"),
    ("async_multi_turn", ["trainer.mode=one_step_off", f"{ARR}.hybrid_engine=false", f"{ARR}.rollout.pool_nodes=[2]",
                          f"{ARR}.rollout.multi_turn.enable=true", "data.return_raw_chat=true"],
     f"{ARR}.rollout.multi_turn.enable=false"),
    ("async_one_step_bound", ["trainer.mode=one_step_off", f"{ARR}.hybrid_engine=false", f"{ARR}.rollout.pool_nodes=[2]",
                              "async_training.max_staleness=2"], "async_training.max_staleness=1"),
]


@pytest.mark.parametrize("name, overrides, key", RULE_CASES, ids=[case[0] for case in RULE_CASES])
def test_cross_component_rule_names_the_key(name, overrides, key):
    cfg = to_run_config(compose_config(overrides))  # each section is fine on its own
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(cfg)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides)  # which validates


def test_fixed_variants_of_the_rules_pass():
    validate(_cfg("trainer.n_cpu_ranks=4"))  # tp=2 on 4 ranks: dp=2
    validate(_cfg("trainer.mode=fully_async", f"{ARR}.hybrid_engine=false", f"{ARR}.rollout.pool_nodes=[2]",
                  "async_training.max_staleness=3", "async_training.partial_rollout=true"))
    # context and sequence parallelism run on CPU too
    validate(_cfg("trainer.n_cpu_ranks=4", f"{ARR}.actor.parallel.cp=2"))
    validate(_cfg(f"{ARR}.actor.parallel.sequence_parallel=true"))
    validate(_cfg(f"{ARR}.rollout.multi_turn.enable=true", "data.return_raw_chat=true"))
    validate(_cfg("algorithm.adv_estimator=gae", "critic.enable=true", "trainer.critic_warmup=1",
                  "critic.parallel.tp=2", "critic.ppo_mini_batch_size=8"))
    validate(_cfg("recipe=qwen2_5_7b_grpo", f"{ARR}.rollout.enforce_eager=false",
                  f"{ARR}.rollout.free_cache_engine=false"))
    validate(_cfg(f"{ARR}.hybrid_engine=false", f"{ARR}.rollout.pool_nodes=[2]"))
    validate(_cfg(f"{ARR}.actor.router_replay.mode=compare"))


def test_cuda_graphs_go_with_a_released_kv_cache_on_sglang(caplog):
    """SGLang keeps its CUDA graphs across release/resume (memory saver, ``cuda_graph`` tag): free_cache_engine no
    longer forces enforce_eager. The hf engine never captures graphs: enforce_eager=false is named as ignored."""
    cfg = _cfg("recipe=qwen2_5_7b_grpo", f"{ARR}.rollout.enforce_eager=false", f"{ARR}.rollout.free_cache_engine=true")
    assert cfg.actor_rollout_ref.rollout.name == "sglang" and cfg.trainer.device == "cuda"
    with caplog.at_level("WARNING", logger="megarl.config.checks"):
        validate(cfg)
    assert "enforce_eager" not in caplog.text
    with caplog.at_level("WARNING", logger="megarl.config.checks"):
        validate(_cfg(f"{ARR}.rollout.enforce_eager=false"))  # the tiny recipe: the hf engine
    assert f"{ARR}.rollout.enforce_eager=False is ignored by the hf engine" in caplog.text


def test_the_tiny_architectures_the_config_names_are_the_ones_megarl_builds():
    from megarl.config.model import TINY_ARCHS
    from megarl.models.tiny import TINY_ARCHS as BUILT

    assert set(TINY_ARCHS) == set(BUILT)


def test_sections_check_themselves_without_hydra():
    with pytest.raises(ValueError, match=r"data\.train_files"):
        DataConfig(train_files=[])
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu"):
        ActorConfig(ppo_micro_batch_size_per_gpu=None)
    ActorConfig(ppo_micro_batch_size_per_gpu=None, use_dynamic_bsz=True)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.gpu_memory_utilization"):
        RolloutConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"trainer\.resume_from_path"):
        TrainerConfig(resume_mode="resume_path")


def test_rollout_widths_default_to_data_lengths():
    cfg = load_config(["data.max_prompt_length=48", "data.max_response_length=12"])
    assert cfg.rollout_widths() == (48, 12)
    cfg = load_config(["data.max_prompt_length=48", f"{ARR}.rollout.prompt_length=60"])
    assert cfg.rollout_widths()[0] == 60
    assert cfg.actor_rollout_ref.rollout.val_kwargs.temperature == 0.0


# ------------------------------------------------------------------------------------------ verl options

def test_clip_ratio_is_the_fallback_of_unset_clip_ratio_low_and_high():
    assert ActorConfig().clip_range == (0.2, 0.2)  # the default is unchanged: low = high = 0.2
    assert ActorConfig().clip_ratio_low is None and ActorConfig().clip_ratio_high is None
    assert ActorConfig(clip_ratio=0.3).clip_range == (0.3, 0.3)
    assert ActorConfig(clip_ratio=0.3, clip_ratio_high=0.28).clip_range == (0.3, 0.28)
    assert ActorConfig(clip_ratio=0.3, clip_ratio_low=0.1, clip_ratio_high=0.5).clip_range == (0.1, 0.5)
    assert ActorConfig(clip_ratio=0.3, clip_ratio_low=0.0).clip_range == (0.0, 0.3)  # 0 is a value, not unset

    # One row, ratios exp(+-0.4) = 1.4918, 0.6703 with advantages +1, -1: clipped at 1.3 / 0.7 by 0.3,
    # at 1.2 / 0.8 by the default 0.2. Loss = mean(-1.3, 0.7) = -0.3 vs mean(-1.2, 0.8) = -0.2.
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    logp = old + torch.tensor([[0.4, -0.4]], dtype=torch.float64)
    adv, mask = torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2)

    def loss_of(actor: ActorConfig) -> float:
        low, high = actor.clip_range
        loss, _ = policy_loss(logp, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high,
                              clip_ratio_c=actor.clip_ratio_c)
        return float(loss)

    assert loss_of(ActorConfig(clip_ratio=0.3)) == loss_of(ActorConfig(clip_ratio_low=0.3, clip_ratio_high=0.3))
    assert loss_of(ActorConfig(clip_ratio=0.3)) == pytest.approx(-0.3, abs=1e-12)
    assert loss_of(ActorConfig()) == pytest.approx(-0.2, abs=1e-12)
    # Explicit low/high win over clip_ratio: low 0.1 -> 0.9 for the negative token, high 0.5 -> 1.4918 unclipped.
    explicit = loss_of(ActorConfig(clip_ratio=0.3, clip_ratio_low=0.1, clip_ratio_high=0.5))
    assert explicit == pytest.approx((-1.4918247 + 0.9) / 2, abs=1e-6)
    assert explicit == loss_of(ActorConfig(clip_ratio_low=0.1, clip_ratio_high=0.5))


def test_clip_ratio_from_the_command_line_and_its_errors():
    actor = load_config([f"{ARR}.actor.clip_ratio=0.3"]).actor_rollout_ref.actor
    assert actor.clip_range == (0.3, 0.3)
    actor = load_config([f"{ARR}.actor.clip_ratio=0.3", f"{ARR}.actor.clip_ratio_high=0.28"]).actor_rollout_ref.actor
    assert actor.clip_range == (0.3, 0.28)
    assert load_config([]).actor_rollout_ref.actor.clip_range == (0.2, 0.2)
    with pytest.raises(ValueError, match=rf"{ARR}\.actor\.clip_ratio \(clip_ratio_low: null\) must be in \[0, 1\)"):
        load_config([f"{ARR}.actor.clip_ratio=1.5"])
    with pytest.raises(ValueError, match=rf"{ARR}\.actor\.clip_ratio_low must be in \[0, 1\)"):
        load_config([f"{ARR}.actor.clip_ratio_low=1.0"])
    with pytest.raises(ValueError, match=rf"{ARR}\.actor\.clip_ratio \(clip_ratio_high: null\) must be >= 0"):
        ActorConfig(clip_ratio=-0.1, clip_ratio_low=0.2)
    with pytest.raises(ValueError, match=rf"{ARR}\.actor\.clip_ratio_high must be >= 0"):
        ActorConfig(clip_ratio_high=-0.1)


@pytest.mark.parametrize("kind", ["k1+", "k2+", "k3+", "low_var_kl+", "abs+", "kl+", "mse+"])
def test_straight_through_kl_kinds_are_accepted(kind):
    cfg = load_config([f"{ARR}.actor.kl_loss_type={kind}", f"algorithm.kl_penalty={kind}"])
    assert cfg.actor_rollout_ref.actor.kl_loss_type == kind and cfg.algorithm.kl_penalty == kind


@pytest.mark.parametrize("override, key", [
    (f"{ARR}.actor.kl_loss_type=k4+", f"{ARR}.actor.kl_loss_type"),
    (f"{ARR}.actor.kl_loss_type=full+", f"{ARR}.actor.kl_loss_type"),
    ("algorithm.kl_penalty=k3++", "algorithm.kl_penalty"),
    (f"{ARR}.actor.loss_agg_mode=token-summ", f"{ARR}.actor.loss_agg_mode"),
    ("critic.loss_agg_mode=sum", "critic.loss_agg_mode"),
])
def test_unknown_kl_kind_or_agg_mode_names_the_setting(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + r"=.*is unknown"):
        load_config([override])


def test_token_sum_is_accepted_for_actor_and_critic():
    cfg = load_config(["recipe=qwen2_5_7b_ppo", f"{ARR}.actor.loss_agg_mode=token-sum",
                       "critic.loss_agg_mode=token-sum"])
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "token-sum"
    assert cfg.critic.loss_agg_mode == "token-sum"


def test_an_engine_on_whole_nodes_is_accepted():
    """TP=16 SGLang engines on the 70B recipe's 8-GPU nodes: each takes two whole nodes."""
    from megarl.plan.placement import placement_for

    cfg = load_config(["recipe=llama3_1_70b_grpo", f"{ARR}.rollout.tensor_model_parallel_size=16"])
    assert [e.nodes for e in placement_for(cfg).engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("key, value, message", [
    ("trainer.mode", "async", "trainer.mode"), ("async_training.pause_mode", "abort", "async_training.pause_mode=abort"),
    ("async_training.stale_policy", "keep", "async_training.stale_policy"),
    ("async_training.max_staleness", "-1", "async_training.max_staleness")])
def test_async_training_settings_check_themselves(key, value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config([f"{key}={value}"])


@pytest.mark.parametrize("key, value", [
    ("trainer.experiment_name", "'../../x'"), ("trainer.experiment_name", "/tmp/elsewhere"),
    ("trainer.project_name", "'..'"), ("trainer.experiment_name", "a/b"), ("trainer.project_name", "''")])
def test_run_names_stay_inside_the_roots(key, value):
    """``experiment_name='../../x'`` or an absolute path used to put checkpoints and logs outside their roots."""
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}=.* must name one folder"):
        load_config([f"{key}={value}"])
    assert load_config(["trainer.experiment_name=qwen-7b_run.2"]).trainer.experiment_name == "qwen-7b_run.2"


@pytest.mark.parametrize("overrides, message", [
    ([f"{ARR}.rollout.n=1"], r"adv_estimator=grpo compares the samples of each prompt, but actor_rollout_ref\.rollout"
                             r"\.n=1: every advantage would be 0"),
    (["algorithm.adv_estimator=rloo", f"{ARR}.rollout.n=1"], r"adv_estimator=rloo .*every advantage would be 0"),
    ([f"{ARR}.rollout.temperature=0"], r"rollout\.temperature=0 samples greedily: the \d+ samples are alike"),
    ([f"{ARR}.rollout.do_sample=false"], r"rollout\.do_sample=False samples greedily")])
def test_group_estimators_need_distinct_samples(overrides, message):
    """GRPO with n=1, or greedy sampling with n>1, used to run with no learning signal and no warning."""
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_greedy_duplicates_under_a_critic_are_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config.checks"):
        load_config(["recipe=qwen2_5_7b_ppo", f"{ARR}.rollout.n=2", f"{ARR}.rollout.temperature=0"])
    assert "generates the same response 2 times per prompt" in caplog.text


def test_lora_settings_take_verls_keys_and_name_what_is_wrong():
    """``actor_rollout_ref.model.lora_rank`` / ``lora_alpha`` / ``target_modules`` (verl's keys): all-linear, Megatron's
    or PEFT's names; a fused layer's parts together; refusals name the setting."""
    from megarl.config import load_config
    from megarl.config.lora import lora_targets

    model = load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.lora_rank=8"]).actor_rollout_ref.model
    spec = model.lora_spec
    assert (spec.rank, spec.alpha, spec.targets, spec.scale) == (
        8, 16.0, ("linear_qkv", "linear_fc1", "linear_proj", "linear_fc2"), 2.0)
    assert load_config(["recipe=tiny_cpu_grpo"]).actor_rollout_ref.model.lora_spec is None
    assert lora_targets(["q_proj", "k_proj", "v_proj", "down_proj"]) == ("linear_qkv", "linear_fc2")
    assert lora_targets("linear_proj") == ("linear_proj",)
    assert lora_targets(["linear_fc1", "gate_proj"]) == ("linear_fc1",)
    with pytest.raises(ValueError, match=r"target_modules: 'q_proj' is part of Megatron's fused 'linear_qkv' "
                                         r"\(\['k_proj', 'q_proj', 'v_proj'\]\), which is adapted whole: add "
                                         r"\['k_proj'\] or name 'linear_qkv'"):
        lora_targets(["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"target_modules: unknown module\(s\) \['lm_head'\]"):
        lora_targets(["lm_head"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.target_modules: unknown module\(s\) \['qkv'\]"):
        load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.lora_rank=8",
                     "actor_rollout_ref.model.target_modules=[qkv]"])
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.lora_rank=-1 must be >= 0"):
        load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.lora_rank=-1"])


def test_lora_sync_modes_and_what_they_refuse():
    """``rollout.lora_sync``: ``adapters`` (the default) makes the engines serve the run's adapter; ``merged`` and a
    run without LoRA leave them plain; partial rollouts hold requests across a sync, which keep the adapter they
    started with: refused with adapters, naming the settings."""
    from megarl.config import load_config

    lora = ["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.lora_rank=8"]
    assert load_config(lora).lora_syncs_adapters
    assert not load_config(lora + ["actor_rollout_ref.rollout.lora_sync=merged"]).lora_syncs_adapters
    assert not load_config(["recipe=tiny_cpu_grpo"]).lora_syncs_adapters
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.lora_sync='?full'?"):
        load_config(lora + ["actor_rollout_ref.rollout.lora_sync=full"])
    partial = ["trainer.mode=fully_async", "async_training.partial_rollout=true",
               "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.pool_nodes=[1]"]
    with pytest.raises(ValueError, match=r"a held request keeps the adapter it started with; set "
                                         r"actor_rollout_ref.rollout.lora_sync=merged"):
        load_config(lora + partial)
    load_config(lora + partial + ["actor_rollout_ref.rollout.lora_sync=merged"])


@pytest.mark.parametrize("override", [
    "actor_rollout_ref.rollout.engine_timeout_s=nan", "actor_rollout_ref.model.lora_alpha=nan",
    "actor_rollout_ref.actor.kl_loss_coef=nan", "actor_rollout_ref.rollout.temperature=nan",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.hidden_dropout=nan",
    "algorithm.kl_ctrl.kl_coef=nan"])
def test_nan_is_refused_wherever_it_is_set(override):
    """Every comparison with NaN is false, so ``value <= 0`` checks let it through: ``engine_timeout_s=nan`` turned
    the frozen-engine watch off, ``lora_alpha=nan`` and ``kl_loss_coef=nan`` trained nothing to rc 0. Refused before
    anything runs, naming the key."""
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=nan: set a number$"):
        load_config([override])
