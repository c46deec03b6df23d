"""Run set-up before Ray: the policy's directory is checked, naming the key and what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config as _load_config
from megarl.controller.run_inputs import prepare_policy

ARR = "actor_rollout_ref"
TINY = "recipe=tiny_cpu_grpo"
"""The config these tests vary (megarl-train's default; the base config, a GPU run, names no model or data)."""


def load_config(overrides=()):
    return _load_config([TINY, *overrides])

REPO = Path(__file__).resolve().parents[2]


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
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("train.parquet", "test.parquet"):  # the recipe's data files: present
        pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1 + 1"}],
                                              "data_source": "addition", "reward_model": {"ground_truth": "2"}}]),
                       tmp_path / "data" / "addition" / name)
    prepare_policy(_cfg(save_tiny(tmp_path / "model", num_layers=1)))


def test_missing_data_is_refused_and_never_filled_in_except_at_the_tiny_recipe_paths(tmp_path, monkeypatch):
    """The tiny recipe's generator used to write addition problems wherever data.train_files pointed."""
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


def test_data_without_the_prompt_column_or_not_parquet_is_refused_naming_the_file(tmp_path):
    """Under the tiny recipe a file without a ``prompt`` column failed in the warm start with a pyarrow
    schema dump; now every data file's schema is read first, and the error names the key, the file and the column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    no_prompt = tmp_path / "questions.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1 + 1", "data_source": "x"}]), no_prompt)
    with pytest.raises(ValueError, match=rf"data\.val_files: {no_prompt} has no column 'prompt' \(data\.prompt_key\)"
                                         rf" holding the chat messages; its columns are \['question', 'data_source'\]"):
        prepare_policy(load_config([f"data.val_files=[{no_prompt}]"]))  # the tiny recipe; before its warm start
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet")
    with pytest.raises(ValueError, match=rf"data\.train_files: {garbage} is not a readable parquet file"):
        prepare_policy(load_config([f"data.train_files=[{garbage}]"]))
    unscored = tmp_path / "unscored.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1 + 1"}]}]), unscored)
    with pytest.raises(ValueError, match=rf"data\.val_files: {unscored} has no column\(s\) \['data_source', "
                                         rf"'reward_model'\], which pick each row's reward scorer"):
        prepare_policy(load_config([f"data.val_files=[{unscored}]"]))


def test_inputs_outside_the_config_are_checked_before_placement(tmp_path, monkeypatch):
    from megarl.controller.run_inputs import check_run_inputs

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match=r"trainer\.device=cuda but this machine has no usable CUDA GPU"):
        check_run_inputs(load_config(["recipe=qwen2_5_7b_grpo"]))  # no GPU here
    cfg = load_config([f"{ARR}.rollout.multi_turn.enable=true", "data.return_raw_chat=true",
                       f"{ARR}.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}"])
    with pytest.raises(ValueError, match=rf"{ARR}\.rollout\.multi_turn\.tool_config_path=.*tools\.yaml' does not exist"):
        check_run_inputs(cfg)
    check_run_inputs(load_config())  # the tiny recipe: nothing outside the config is missing


def test_a_block_fp8_policy_without_fp8_engines_is_refused_naming_the_key(tmp_path):
    """A policy published in block FP8 (DeepSeek-V3): engines started from it serve FP8, so the sync must quantize
    (``rollout.quantization=fp8``); refused before anything else runs."""
    from megarl.convert.fp8 import write_fp8_checkpoint
    from megarl.models.tiny import build_tiny_tokenizer, save_tiny

    policy = save_tiny(tmp_path / "bf16", num_layers=1)
    fp8 = write_fp8_checkpoint(policy, tmp_path / "fp8").directory
    build_tiny_tokenizer().save_pretrained(fp8)
    with pytest.raises(ValueError, match=rf"{ARR}\.model\.path=.* holds block-FP8 weights .* set "
                                         rf"{ARR}\.rollout\.quantization=fp8"):
        prepare_policy(_cfg(fp8))


def test_prompts_that_only_fit_without_the_tool_schemas_are_refused_before_placement(tmp_path):
    """The tiny recipe with the GSM8K tool used to fail every rollout ("prompt has 401 tokens ... more
    than 64") and go on with rc 0; the schemas now count when filtering, and a set left empty is an error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.controller.build import build_datasets, load_agent_plugins
    from megarl.models.tiny import save_tiny
    from tests.scripted_engine import tiny_tokenizer

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"ground_truth": str(i + 1)}, "extra_info": {"index": i}} for i in range(4)]
    data = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    tools = REPO / "configs" / "tools" / "gsm8k_tool_config.yaml"
    policy = save_tiny(tmp_path / "policy", num_layers=1)  # the tiny recipe's cache need not exist yet
    overrides = [f"{ARR}.model.path={policy}", f"data.train_files=[{data}]", "data.val_files=[]",
                 "data.max_prompt_length=64",
                 "data.return_raw_chat=true", f"{ARR}.rollout.multi_turn.enable=true"]
    tokenizer = tiny_tokenizer()
    without_tools = load_config(overrides)
    train, _ = build_datasets(without_tools, tokenizer, load_agent_plugins(without_tools), console=lambda *_: None)
    assert len(train) == 4  # ~20 tokens each: they fit without tools
    with_tools = load_config([*overrides, f"{ARR}.rollout.multi_turn.tool_config_path={tools}"])
    with pytest.raises(ValueError, match=r"every one of the 4 prompts of data\.train_files is longer than "
                                         r"data\.max_prompt_length=64 \(the 1 tool schemas included\): the "
                                         r"shortest has \d{3} tokens; raise data\.max_prompt_length"):
        build_datasets(with_tools, tokenizer, load_agent_plugins(with_tools), console=lambda *_: None)


def test_routing_replay_shape_comes_from_the_policy_and_a_dense_policy_is_refused(tmp_path):
    """``routing_shape``: (layers, top-k) of a mixture-of-experts policy with ``router_replay`` on, None when off; a
    dense policy with it on is refused naming the key, before anything is placed."""
    from megarl.controller.run_inputs import routing_shape
    from megarl.models.tiny import save_tiny

    moe = save_tiny(tmp_path / "moe", arch="qwen3_moe", num_layers=3)
    dense = save_tiny(tmp_path / "dense", num_layers=1)
    key = "actor_rollout_ref.actor.router_replay.mode"
    assert routing_shape(load_config([f"actor_rollout_ref.model.path={moe}", f"{key}=replay"])) == (3, 2)
    assert routing_shape(load_config([f"actor_rollout_ref.model.path={moe}"])) is None
    with pytest.raises(ValueError, match=rf"{key}=compare needs a mixture-of-experts policy; .* is a qwen2 model"):
        routing_shape(load_config([f"actor_rollout_ref.model.path={dense}", f"{key}=compare"]))


def _role_checkpoint(directory: Path, layout: dict, world_size: int) -> None:
    import json

    from megarl.workers.model_checkpoint import FORMAT, METADATA_FILE

    (directory / "dist").mkdir(parents=True)
    (directory / "dist" / "metadata.json").write_text("{}")
    (directory / METADATA_FILE).write_text(json.dumps({"format": FORMAT, "layout": layout, "world_size": world_size}))


def test_a_checkpoint_saved_at_another_layout_is_refused_before_ray(tmp_path):
    """Resuming a TP=2 checkpoint at TP=1 used to fail after 18 s of start-up inside a worker, suggesting a Python
    function; now the run's set-up refuses it, naming both layouts and the keys."""
    from megarl.controller.run_inputs import check_resume_layout

    checkpoint = tmp_path / "global_step_3"
    _role_checkpoint(checkpoint / "actor", {"tp": 2, "pp": 1, "vpp": 1, "cp": 1, "dp": 1, "ep": 1, "etp": 2}, 2)
    tiny = load_config()  # the tiny recipe: TP=2 on 2 CPU ranks
    check_resume_layout(tiny, checkpoint)
    check_resume_layout(tiny, None)
    with pytest.raises(ValueError, match=r"global_step_3/actor was saved at TP2×PP1×VPP1×CP1×DP1 on 2 ranks, but "
                                         r"this run.s layout is TP1×PP1×VPP1×CP1×DP2 on 2 ranks: .* set "
                                         r"actor_rollout_ref\.actor\.parallel\.\* \(tp, pp, vpp, cp, ep, etp\)"):
        check_resume_layout(load_config([f"{ARR}.actor.parallel.tp=1"]), checkpoint)
    ppo = load_config(["algorithm.adv_estimator=gae", "critic.enable=true", "critic.ppo_mini_batch_size=8"])
    with pytest.raises(ValueError, match=r"has no critic/ directory, and this run trains a critic"):
        check_resume_layout(ppo, checkpoint)


def test_a_lora_checkpoint_of_other_adapters_is_refused_before_ray(tmp_path):
    """Resuming adapters of another rank or targets failed after Ray and the model build, the cause only in
    error.log: the checkpoint's model.json says what it holds, and the set-up refuses a mismatch naming the keys."""
    import json

    from megarl.controller.run_inputs import check_resume_layout
    from megarl.workers.model_checkpoint import METADATA_FILE

    checkpoint = tmp_path / "global_step_2"
    layout = {"tp": 2, "pp": 1, "vpp": 1, "cp": 1, "dp": 1, "ep": 1, "etp": 2}
    _role_checkpoint(checkpoint / "actor", layout, 2)
    meta = json.loads((checkpoint / "actor" / METADATA_FILE).read_text())
    meta["lora"] = {"rank": 8, "alpha": 16.0, "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}
    (checkpoint / "actor" / METADATA_FILE).write_text(json.dumps(meta))
    lora = [f"{ARR}.model.lora_rank=8", f"{ARR}.model.lora_alpha=16"]
    check_resume_layout(load_config(lora), checkpoint)
    with pytest.raises(ValueError, match=r"holds LoRA adapters of rank 8 \(this run: 16\): .* set "
                                         r"actor_rollout_ref\.model\.lora_rank, lora_alpha and target_modules"):
        check_resume_layout(load_config([f"{ARR}.model.lora_rank=16", f"{ARR}.model.lora_alpha=16"]), checkpoint)
    with pytest.raises(ValueError, match=r"targets \['linear_fc1', 'linear_fc2', 'linear_proj', 'linear_qkv'\] "
                                         r"\(this run: \['linear_qkv'\]\)"):
        check_resume_layout(load_config([*lora, f"{ARR}.model.target_modules=[linear_qkv]"]), checkpoint)
    with pytest.raises(ValueError, match=r"holds LoRA adapters .* and this run has none"):
        check_resume_layout(load_config(), checkpoint)


def test_a_cpu_run_whose_weights_and_states_exceed_the_machine_is_refused_before_ray(tmp_path):
    """On cpu the planner has no device memory to plan, but the run's weights, gradients, Adam moments, reference
    and engine copies still take host memory: a run that cannot hold them is refused before Ray, with the parts."""
    from megarl.models.tiny import save_tiny
    from megarl.plan.preflight import cpu_host_bytes, preflight

    dense = save_tiny(tmp_path / "dense")
    base = ["recipe=tiny_cpu_grpo", f"actor_rollout_ref.model.path={dense}", "actor_rollout_ref.model.init=pretrained"]
    cfg = load_config(base)
    parts = cpu_host_bytes(cfg)
    from megarl.models.sizes import architecture_for

    params = architecture_for(str(dense), key="model.path").num_params
    # tiny recipe: TP=2 on 2 ranks (one replica), fp32, a reference model (KL loss), two engines
    assert parts == {"actor weights": params * 4, "actor gradients": params * 4, "actor Adam moments": params * 8,
                     "reference weights": params * 4, "engine weights": 2 * params * 4}
    assert preflight(cfg) is None
    with pytest.raises(ValueError, match=r"this cpu run holds at least 0\.\d GiB in host memory \(actor weights "
                                         r".*more than the machine's 0\.0 GiB \(trainer.host_memory_gb\)"):
        preflight(load_config([*base, "trainer.host_memory_gb=0.000001"]))


def test_a_local_ray_cluster_is_put_on_loopback_with_a_token(monkeypatch):
    """``megarl-train``'s own Ray cluster authenticates with a fresh token, and its driver's Ray takes loopback
    as the node's address (the pinned Ray's own switch, which its node-address choice reads), put back when the run
    ends; the environment is left alone (a process that inherited the switch could not start a multi-node cluster);
    a joined cluster and the user's settings are left as they are. (The e2e Ctrl-C test lists the run's listening
    sockets: loopback only.)"""
    import os

    from ray._private import ray_constants, services

    from megarl.cli.train import local_ray_settings
    from megarl.controller.build import ray_on_loopback
    from megarl.parallel.net import RAY_LOOPBACK_VARIABLE

    assert RAY_LOOPBACK_VARIABLE == ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", RAY_LOOPBACK_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    local_ray_settings()
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
    before = ray_constants.ENABLE_RAY_CLUSTER
    restore = ray_on_loopback()
    try:
        import ray

        if not ray.is_initialized():  # (a Ray already up answers with its own node's address)
            assert services.get_node_ip_address() in ("127.0.0.1", "::1")  # what ray.init hands its processes
        assert RAY_LOOPBACK_VARIABLE not in os.environ
    finally:
        restore()
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    monkeypatch.setenv(RAY_LOOPBACK_VARIABLE, "1")  # the user's choice wins
    ray_on_loopback()()
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # joining a cluster: its own settings
    local_ray_settings()
    assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(os.environ)


def test_lora_on_a_mixture_of_experts_policy_is_refused_before_ray(tmp_path):
    from megarl.controller.run_inputs import check_policy_support
    from megarl.models.tiny import save_tiny

    moe = save_tiny(tmp_path / "moe", arch="qwen3_moe")
    dense = save_tiny(tmp_path / "dense")
    check_policy_support(_load_config(["recipe=tiny_cpu_grpo", f"actor_rollout_ref.model.path={dense}",
                                       "actor_rollout_ref.model.init=pretrained",
                                       "actor_rollout_ref.model.lora_rank=8"]))
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.lora_rank=8: LoRA on mixture-of-experts models is "
                                         r"not supported yet .* is a qwen3_moe model"):
        check_policy_support(_load_config(["recipe=tiny_cpu_grpo", f"actor_rollout_ref.model.path={moe}",
                                           "actor_rollout_ref.model.init=pretrained",
                                           "actor_rollout_ref.model.lora_rank=8"]))


def test_a_lora_rank_above_the_adapted_layers_width_is_refused_before_ray(tmp_path):
    """The tiny Qwen2's narrowest adapted modules are k_proj and v_proj (64 -> 2 key/value heads x 16 = 32): a rank
    of 32 is the most an adapter there can use; 100 000 (which took the machine's memory minutes into a run) is
    refused naming the module and the key; without k/v in the targets, q_proj/o_proj's 64 bound it."""
    from megarl.controller.run_inputs import check_policy_support
    from megarl.models.tiny import save_tiny

    dense = save_tiny(tmp_path / "dense")
    base = ["recipe=tiny_cpu_grpo", f"actor_rollout_ref.model.path={dense}", "actor_rollout_ref.model.init=pretrained"]
    check_policy_support(_load_config([*base, "actor_rollout_ref.model.lora_rank=32"]))
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.lora_rank=100000 is above the width of the adapted "
                                         r"k_proj \(32 of actor_rollout_ref.model.path=.*set lora_rank <= 32"):
        check_policy_support(_load_config([*base, "actor_rollout_ref.model.lora_rank=100000"]))
    with pytest.raises(ValueError, match=r"lora_rank=65 is above the width of the adapted (o_proj|q_proj) \(64"):
        check_policy_support(_load_config([*base, "actor_rollout_ref.model.lora_rank=65",
                                           "actor_rollout_ref.model.target_modules=[linear_proj]"]))


@pytest.mark.parametrize("setting", ["actor_rollout_ref.model.lora_rank=8",
                                     "actor_rollout_ref.actor.parallel.cp=2", "reward_model.enable=true"])
def test_what_a_vision_language_policy_cannot_do_yet_is_refused_before_ray(tmp_path, setting):
    from megarl.controller.run_inputs import check_policy_support
    from megarl.models.tiny import save_tiny_vl

    model = save_tiny_vl(tmp_path / "vl")
    base = ["recipe=tiny_cpu_vl_grpo", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.init=pretrained"]
    check_policy_support(_load_config(base))
    extra = {"reward_model": ["reward_model.model.path=" + str(model)],
             "actor_rollout_ref.actor.parallel.cp": ["actor_rollout_ref.actor.parallel.tp=1"]}
    extra = next((more for prefix, more in extra.items() if setting.startswith(prefix)), [])
    key = setting.split("=")[0]
    with pytest.raises(ValueError, match=f"{key}: not supported yet with a vision-language policy .* a qwen2_5_vl model"):
        check_policy_support(_load_config([*base, setting, *extra]))
