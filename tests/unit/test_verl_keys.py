"""verl's names accepted as what they are: verl's five Megatron example scripts compose and validate with
``rollout.name=vllm → sglang`` as the only change, carrying verl's values; ``rollout.name=vllm`` exits 2 naming
SGLang; a key with no meaning here is refused with the nearest keys.

The override lists are the scripts' own (volcengine/verl ``examples/``) as the shell hands them to Python: quotes
removed, variables expanded with the scripts' defaults, ``$HOME`` as ``/home/u``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from megarl.cli.train import main as train_main
from megarl.config import ConfigError, load_config
from megarl.config.keys import declared_keys, is_declared
from megarl.config.trainer import LOGGERS
from megarl.config.verl_keys import VERL_KEYS, VERL_PREFIXES, Equal, Fixed, Ignored, Rename, lookup, translate

REPO = Path(__file__).resolve().parents[2]
A, REF, R = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout"
FILES = ("data.train_files=['/home/u/data/gsm8k/train.parquet', '/home/u/data/math/train.parquet']",
         "data.val_files=['/home/u/data/gsm8k/test.parquet', '/home/u/data/math/test.parquet']")
GRPO_COMMON = ("algorithm.adv_estimator=grpo", *FILES, "data.train_batch_size=1024", "data.max_prompt_length=1024",
               "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation=error",
               "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", f"{A}.optim.lr=1e-6",
               f"{A}.ppo_mini_batch_size=256")
KL = (f"{A}.use_kl_loss=True", f"{A}.kl_loss_coef=0.001", f"{A}.kl_loss_type=low_var_kl", f"{A}.entropy_coeff=0")
TRAINER = ("algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", 'trainer.logger=["console","wandb"]')

SCRIPTS = {
    "grpo_trainer/run_qwen2-7b_math_megatron.sh": [
        *GRPO_COMMON[:2], "data.return_raw_chat=True", *GRPO_COMMON[2:], "actor_rollout_ref.model.use_fused_kernels=True",
        f"{A}.ppo_micro_batch_size_per_gpu=4", f"{A}.megatron.pipeline_model_parallel_size=2",
        f"{A}.megatron.tensor_model_parallel_size=2", *KL, f"{R}.log_prob_micro_batch_size_per_gpu=4",
        f"{R}.tensor_model_parallel_size=2", f"{R}.name=vllm", f"{R}.mode=async", f"{R}.gpu_memory_utilization=0.6",
        f"{R}.n=5", f"{REF}.log_prob_micro_batch_size_per_gpu=4", f"{REF}.megatron.pipeline_model_parallel_size=2",
        f"{REF}.megatron.tensor_model_parallel_size=2", *TRAINER, "trainer.project_name=verl_grpo_example_gsm8k_math",
        "trainer.experiment_name=qwen2_7b_megatron", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
        "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15"],
    "grpo_trainer/run_qwen2-7b_sgl_megatron.sh": [
        *GRPO_COMMON, f"{A}.ppo_micro_batch_size_per_gpu=4", f"{A}.megatron.pipeline_model_parallel_size=2",
        f"{A}.megatron.virtual_pipeline_model_parallel_size=2", f"{A}.megatron.tensor_model_parallel_size=4", *KL,
        f"{R}.log_prob_micro_batch_size_per_gpu=4", f"{R}.tensor_model_parallel_size=2", f"{R}.name=sglang",
        f"{R}.gpu_memory_utilization=0.6", f"{R}.n=5", f"{REF}.log_prob_micro_batch_size_per_gpu=4", *TRAINER,
        "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=qwen2_7b_function_rm_megatron",
        "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=5",
        "trainer.total_epochs=15"],
    "grpo_trainer/run_qwen2-7b_seq_balance_math_megatron.sh": [
        *GRPO_COMMON, f"{A}.use_dynamic_bsz=True", f"{A}.ppo_max_token_len_per_gpu=12000",
        f"{A}.megatron.pipeline_model_parallel_size=2", f"{A}.megatron.tensor_model_parallel_size=2", *KL,
        f"{A}.megatron.param_offload=True", f"{A}.megatron.optimizer_offload=True", f"{A}.megatron.grad_offload=True",
        f"{R}.log_prob_micro_batch_size_per_gpu=4", f"{R}.tensor_model_parallel_size=2",
        f"{REF}.megatron.param_offload=True", f"{R}.name=vllm", f"{R}.gpu_memory_utilization=0.6", f"{R}.n=5",
        f"{REF}.log_prob_micro_batch_size_per_gpu=4", f"{REF}.megatron.pipeline_model_parallel_size=2",
        f"{REF}.megatron.tensor_model_parallel_size=2", *TRAINER, "trainer.project_name=verl_grpo_example_gsm8k_math",
        "trainer.experiment_name=qwen2_7b_megatron", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
        "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15"],
    "grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh": [
        # TRAIN_FILE / TEST_FILE: the script sets TEST_FILE to "['$aime24_test_path']", a variable it never sets
        "data.train_files=/home/u/verl/dataset/dapo-math-17k.parquet", "data.val_files=['']", "data.prompt_key=prompt",
        "data.truncation=left", "data.max_prompt_length=2048", "data.max_response_length=8192",
        "data.train_batch_size=512", f"{R}.n=16", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        "algorithm.kl_ctrl.kl_coef=0.0", "actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B-Base",
        f"{A}.use_kl_loss=False", f"{A}.kl_loss_coef=0.0", f"{A}.clip_ratio_low=0.2", f"{A}.clip_ratio_high=0.28",
        f"{A}.clip_ratio_c=10.0", "+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=10240",
        "actor_rollout_ref.model.use_fused_kernels=False", f"{A}.use_dynamic_bsz=True", f"{A}.ppo_mini_batch_size=128",
        f"{A}.ppo_micro_batch_size_per_gpu=2", f"{A}.ppo_max_token_len_per_gpu=10240", f"{A}.optim.lr=1e-6",
        f"{A}.optim.lr_warmup_steps=10", f"{A}.optim.lr_decay_style=constant", f"{A}.optim.weight_decay=0.1",
        f"+{A}.optim.override_optimizer_config.optimizer_offload_fraction=1.",
        f"+{A}.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=True",
        f"+{A}.optim.override_optimizer_config.use_precision_aware_optimizer=True",
        f"+{A}.optim.override_optimizer_config.optimizer_cpu_offload=True", f"{A}.megatron.use_mbridge=True",
        f"{A}.megatron.use_dist_checkpointing=False", f"{A}.megatron.param_offload=True",
        f"{A}.megatron.grad_offload=True", f"{A}.megatron.optimizer_offload=True",
        f"{A}.megatron.tensor_model_parallel_size=1", f"{A}.megatron.pipeline_model_parallel_size=1",
        f"{A}.megatron.virtual_pipeline_model_parallel_size=null", f"{A}.megatron.context_parallel_size=1",
        f"{A}.megatron.expert_model_parallel_size=8", f"{A}.megatron.expert_tensor_parallel_size=1",
        *(f"+{A}.megatron.override_transformer_config.{k}=True" for k in (
            "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
            "gradient_accumulation_fusion", "deallocate_pipeline_outputs", "persist_layer_norm", "moe_grouped_gemm",
            "moe_permute_fusion")),
        f"+{A}.megatron.override_transformer_config.moe_token_dispatcher_type=flex",
        f"+{A}.megatron.override_transformer_config.moe_router_dtype=fp32",
        f"+{A}.megatron.override_transformer_config.moe_enable_deepep=True", f"{A}.entropy_coeff=0",
        f"{A}.loss_agg_mode=token-mean", f"{R}.log_prob_micro_batch_size_per_gpu=2",
        f"{R}.log_prob_max_token_len_per_gpu=10240", f"{R}.gpu_memory_utilization=0.7",
        f"{R}.tensor_model_parallel_size=4", f"{R}.enable_chunked_prefill=True", f"{R}.max_num_batched_tokens=10240",
        f"{R}.temperature=1.0", f"{R}.top_p=1.0", f"{R}.top_k=-1", f"{R}.val_kwargs.temperature=1.0",
        f"{R}.val_kwargs.top_p=0.7", f"{R}.val_kwargs.top_k=-1", f"{R}.val_kwargs.do_sample=True", f"{R}.val_kwargs.n=1",
        f"{R}.name=vllm", f"{R}.enforce_eager=True", f"{R}.free_cache_engine=True",
        f"{REF}.log_prob_micro_batch_size_per_gpu=2", f"{REF}.log_prob_max_token_len_per_gpu=10240",
        f"{REF}.megatron.use_dist_checkpointing=False", f"{REF}.megatron.param_offload=True",
        f"{REF}.megatron.tensor_model_parallel_size=1", f"{REF}.megatron.pipeline_model_parallel_size=1",
        f"{REF}.megatron.virtual_pipeline_model_parallel_size=null", f"{REF}.megatron.context_parallel_size=1",
        f"{REF}.megatron.expert_model_parallel_size=8", f"{REF}.megatron.expert_tensor_parallel_size=1",
        "reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False", "+reward_model.reward_kwargs.max_resp_len=8192",
        "trainer.logger=[console,wandb]", "trainer.project_name=DAPO-Qwen3-30b-MATH",
        "trainer.experiment_name=DAPO-Qwen3-30b-MATH-megatron", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
        "trainer.val_before_train=False", "trainer.test_freq=10", "trainer.save_freq=100", "trainer.total_epochs=10",
        "trainer.resume_mode=auto", "trainer.log_val_generations=10"],
    "ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh": [
        "algorithm.adv_estimator=gae", *FILES, "data.train_batch_size=1024", "data.max_prompt_length=1024",
        "data.max_response_length=512", "data.filter_overlong_prompts=True", "data.truncation=error",
        "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", f"{A}.optim.lr=1e-6", f"{A}.ppo_mini_batch_size=256",
        f"{A}.ppo_micro_batch_size_per_gpu=4", f"{A}.megatron.pipeline_model_parallel_size=2",
        f"{A}.megatron.tensor_model_parallel_size=2", f"{A}.use_kl_loss=False", f"{R}.log_prob_micro_batch_size_per_gpu=4",
        f"{R}.tensor_model_parallel_size=4", f"{R}.name=vllm", f"{R}.gpu_memory_utilization=0.4",
        f"{REF}.megatron.pipeline_model_parallel_size=2", f"{REF}.megatron.tensor_model_parallel_size=2",
        "critic.optim.lr=1e-5", "critic.model.path=Qwen/Qwen2-7B-Instruct", "critic.ppo_micro_batch_size_per_gpu=4",
        *TRAINER, "trainer.project_name=verl_ppo_gsm8k_math_examples", "trainer.experiment_name=qwen2_7b_megatron",
        "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
        "trainer.total_epochs=100"],
}


def as_megarl_runs(overrides: list[str]) -> list[str]:
    """The one change the acceptance allows (vllm → sglang); and, until megarl's wandb logger lands, console only."""
    out = [o.replace(f"{R}.name=vllm", f"{R}.name=sglang") for o in overrides]
    if "wandb" not in LOGGERS:
        out = [o if not o.startswith("trainer.logger=") else "trainer.logger=[console]" for o in out]
    return out


def test_the_five_scripts_use_108_distinct_keys_and_each_has_a_decision():
    keys = {o.lstrip("+").split("=", 1)[0] for overrides in SCRIPTS.values() for o in overrides}
    assert len(keys) == 108
    undecided = sorted(k for k in keys if not is_declared(k) and lookup(k) is None)
    assert not undecided


REFUSED = {"grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh":
           "optimizer_cpu_offload=True with actor_rollout_ref.actor.optimizer_offload=true"}
"""Scripts whose combination megarl refuses, and the words the refusal names: Megatron's hybrid CPU optimizer with
the RL optimizer offload (its restore would bring the host share's states to the GPU: the second step fails)."""


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_verl_script_composes_and_validates(script, capsys):
    code = train_main(["--print-config", *as_megarl_runs(SCRIPTS[script])])
    err = capsys.readouterr().err
    if script in REFUSED:
        assert code == 2 and REFUSED[script] in err, err
        return
    assert code == 0, err


@pytest.mark.parametrize("script", sorted(s for s, o in SCRIPTS.items() if f"{R}.name=vllm" in o))
def test_vllm_alone_exits_2_naming_sglang(script, capsys):
    overrides = as_megarl_runs(SCRIPTS[script])
    overrides = [o.replace(f"{R}.name=sglang", f"{R}.name=vllm") for o in overrides]
    assert train_main(["--print-config", *overrides]) == 2
    assert "actor_rollout_ref.rollout.name=sglang" in capsys.readouterr().err


def test_verl_values_land_where_megarl_keeps_them():
    cfg = load_config(as_megarl_runs(SCRIPTS["grpo_trainer/run_qwen2-7b_math_megatron.sh"]))
    arr = cfg.actor_rollout_ref
    assert (arr.actor.parallel.tp, arr.actor.parallel.pp, arr.actor.parallel.vpp) == (2, 2, None)
    assert arr.actor.optim.lr == 1e-6 and arr.actor.ppo_mini_batch_size == 256
    assert arr.actor.ppo_micro_batch_size_per_gpu == 4 and arr.ref.log_prob_micro_batch_size_per_gpu == 4
    assert (arr.rollout.name, arr.rollout.n, arr.rollout.tensor_model_parallel_size) == ("sglang", 5, 2)
    assert arr.model.path == "Qwen/Qwen2-7B-Instruct" and arr.model.init == "pretrained"
    assert cfg.data.train_files == ["/home/u/data/gsm8k/train.parquet", "/home/u/data/math/train.parquet"]
    assert cfg.trainer.device == "cuda" and cfg.trainer.total_epochs == 15 and cfg.trainer.save_freq == 20

    sgl = load_config(as_megarl_runs(SCRIPTS["grpo_trainer/run_qwen2-7b_sgl_megatron.sh"])).actor_rollout_ref.actor
    assert (sgl.parallel.tp, sgl.parallel.pp, sgl.parallel.vpp) == (4, 2, 2)

    balance = load_config(as_megarl_runs(SCRIPTS["grpo_trainer/run_qwen2-7b_seq_balance_math_megatron.sh"]))
    actor, ref, rollout = (balance.actor_rollout_ref.actor, balance.actor_rollout_ref.ref,
                           balance.actor_rollout_ref.rollout)
    assert actor.param_offload and actor.grad_offload and actor.optimizer_offload and ref.param_offload
    assert actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu == 12000
    # verl's log-prob micro-batching follows actor.use_dynamic_bsz / ppo_max_token_len_per_gpu
    assert rollout.log_prob_use_dynamic_bsz and ref.log_prob_use_dynamic_bsz
    assert rollout.log_prob_max_token_len_per_gpu == ref.log_prob_max_token_len_per_gpu == 12000


def test_the_moe_script_keeps_its_layout_optimizer_and_overlong_buffer(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config.verl_keys"):
        cfg = load_config(as_megarl_runs(SCRIPTS["grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh"])
                          + ["actor_rollout_ref.actor.optimizer_offload=false"])  # as the refusal says (REFUSED)
    actor = cfg.actor_rollout_ref.actor
    p = actor.parallel
    assert (p.tp, p.pp, p.vpp, p.cp, p.ep, p.etp) == (1, 1, None, 1, 8, 1)
    assert (actor.optim.warmup_steps, actor.optim.decay_style, actor.optim.weight_decay) == (10, "constant", 0.1)
    assert actor.clip_range == (0.2, 0.28) and actor.clip_ratio_c == 10.0
    buffer = cfg.reward_model.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor, buffer.log) == (True, 4096, 1.0, False)
    assert cfg.data.train_files == ["/home/u/verl/dataset/dapo-math-17k.parquet"]  # one string → a list
    assert cfg.actor_rollout_ref.rollout.val_kwargs.top_p == 0.7 and cfg.trainer.log_val_generations == 10
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings  # one line, every ignored key named with its reason
    for key in ("use_mbridge", "max_position_embeddings", "enable_chunked_prefill", "max_num_batched_tokens",
                "use_fused_kernels"):
        assert key in warnings[0]
    # Megatron's own settings pass through to its TransformerConfig and OptimizerConfig
    assert "override_transformer_config" not in warnings[0] and "override_optimizer_config" not in warnings[0]
    transformer = actor.megatron.override_transformer_config
    assert transformer["moe_token_dispatcher_type"] == "flex" and transformer["moe_router_dtype"] == "fp32"
    assert transformer["moe_enable_deepep"] is True and transformer["gradient_accumulation_fusion"] is True
    assert actor.optim.override_optimizer_config == {"optimizer_offload_fraction": 1.0,
                                                     "overlap_cpu_optimizer_d2h_h2d": True,
                                                     "use_precision_aware_optimizer": True,
                                                     "optimizer_cpu_offload": True}


def test_the_ppo_script_trains_a_critic_from_its_path():
    cfg = load_config(as_megarl_runs(SCRIPTS["ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh"]))
    assert cfg.critic.enable and cfg.critic.model_path == "Qwen/Qwen2-7B-Instruct"  # verl's critic.enable: null
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.ppo_micro_batch_size_per_gpu == 4
    assert cfg.algorithm.adv_estimator == "gae" and cfg.trainer.total_epochs == 100


def test_other_renamed_keys():
    cfg = load_config(["recipe=tiny_cpu_grpo", "trainer.total_training_steps=7", "custom_reward_function.path=x.py",
                       "custom_reward_function.name=score", f"{A}.optim.lr_warmup_steps=-1"])
    assert cfg.trainer.total_steps == 7 and cfg.actor_rollout_ref.actor.optim.warmup_steps == 0
    assert cfg.reward_model.custom_reward_function.spec() == "x.py:score"


@pytest.mark.parametrize("override, message", [
    (f"{A}.megatron.use_dist_checkpointing=True", r"megarl loads the Hugging Face weights"),
    (f"{R}.mode=sync", r"always servers"),
    ("reward_model.reward_manager=prime", r"naive one"),
    (f"{REF}.megatron.tensor_model_parallel_size=1", r"differs from actor_rollout_ref\.actor\.parallel\.tp=2: "
                                                     r"megarl's reference model lives on the actor's ranks"),
    (f"{A}.megatron.tensor_model_paralel_size=2", r"did you mean actor_rollout_ref\.actor\.megatron\."
                                                  r"tensor_model_parallel_size"),
    (f"+{A}.megatron.seq_parallel=true", r"is not a megarl setting"),
    ("trainer.totl_steps=3", r"did you mean trainer\.total_steps"),
])
def test_what_has_no_meaning_here_is_refused_saying_why(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["recipe=tiny_cpu_grpo", override])


def test_plus_forms_of_declared_keys_are_accepted():
    cfg = load_config(["recipe=tiny_cpu_grpo", "+trainer.total_steps=3", "++trainer.test_freq=2",
                       f"+{A}.megatron.tensor_model_parallel_size=1"])
    assert (cfg.trainer.total_steps, cfg.trainer.test_freq, cfg.actor_rollout_ref.actor.parallel.tp) == (3, 2, 1)


def test_a_typo_in_a_recipe_names_the_nearest_key(tmp_path):
    from megarl.config.loading import CONFIG_DIR
    from megarl.config.loading import ConfigError as Error

    (tmp_path / "recipe").mkdir()
    (tmp_path / "config.yaml").write_text((CONFIG_DIR / "config.yaml").read_text())
    (tmp_path / "recipe" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  total_stepz: 3\n")
    with pytest.raises(Error, match=r"total_stepz(.|\n)*\(did you mean trainer\.total_steps"):
        load_config(["recipe=typo", "actor_rollout_ref.model.path=m", "data.train_files=x"], config_dir=tmp_path)


def test_overriding_the_model_path_never_starts_the_tiny_warm_start():
    assert load_config(["recipe=tiny_cpu_grpo"]).actor_rollout_ref.model.init == "tiny_sft"
    model = load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.path=/models/qwen"]).actor_rollout_ref.model
    assert model.init == "pretrained"
    kept = load_config(["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.path=/tmp/t", "actor_rollout_ref.model.init=tiny_sft"])
    assert kept.actor_rollout_ref.model.init == "tiny_sft"


def test_the_migration_doc_lists_every_verl_key():
    doc = (REPO / "docs" / "verl_migration.md").read_text()
    missing = [k for k in [*VERL_KEYS, *VERL_PREFIXES] if f"`{k.rstrip('.')}" not in doc]
    assert not missing
    assert "verl_migration.md" in (REPO / "README.md").read_text()


def test_the_table_entries_point_at_declared_keys():
    declared = declared_keys()[0]
    for key, entry in [*VERL_KEYS.items(), *VERL_PREFIXES.items()]:
        assert isinstance(entry, (Rename, Fixed, Equal, Ignored))
        if isinstance(entry, (Rename, Equal)):
            assert entry.key in declared, key
    assert translate(["recipe=x", "trainer.logger=[console,wandb]"]).overrides == [
        "recipe=x", "trainer.logger=[console,wandb]"]  # verl's logger list passes through unchanged


def test_the_base_config_is_a_gpu_run_and_no_arguments_run_the_tiny_job(capsys):
    from megarl.config import compose_config, to_run_config

    base = to_run_config(compose_config(["actor_rollout_ref.model.path=m", "data.train_files=x.parquet"]))
    assert (base.recipe, base.trainer.device, base.trainer.world_size) == ("custom", "cuda", 8)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path and data\.train_files must be set"):
        load_config([])
    assert train_main(["--print-config"]) == 0
    captured = capsys.readouterr()
    assert "recipe: tiny_cpu_grpo" in captured.out and "device: cpu" in captured.out
    assert "no overrides: the tiny CPU job (recipe=tiny_cpu_grpo)" in captured.err
