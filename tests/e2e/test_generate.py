"""``megarl-generate`` (verl's ``main_generation``) end to end on CPU: responses for a JSONL file of prompts, written
back with the rows; greedy responses equal transformers' greedy ``generate`` on the same templated prompts; an
overlong prompt is dropped and counted; verl's key names work; a missing output path is refused naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402

ray = pytest.importorskip("ray")

from megarl.cli.generate import main as generate_main  # noqa: E402
from megarl.config import load_config  # noqa: E402
from megarl.controller.generate import generate_responses  # noqa: E402

CHATS = [
    {"prompt": [{"role": "user", "content": "What is 12 + 30?"}], "id": "a"},
    {"prompt": [{"role": "user", "content": " ".join(["long"] * 200)}], "id": "too long"},
    {"prompt": [{"role": "user", "content": "What is 99 + 1?"}], "id": "c"},
]
TEXTS = [{"prompt": "What is 7 + 8?", "id": "b"}]  # strings: one user message each (slime's raw prompts)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megarl.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("generate")
    chats, texts = root / "chats.jsonl", root / "texts.json"
    chats.write_text("".join(json.dumps(row) + "\n" for row in CHATS))
    texts.write_text(json.dumps(TEXTS))
    model = save_tiny(root / "model", num_layers=2)
    import torch
    from transformers import AutoModelForCausalLM

    # A random tiny model answers every prompt with the same token: noise on its weights makes answers differ.
    hf = AutoModelForCausalLM.from_pretrained(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    hf.save_pretrained(model)
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}})
    yield {"root": root, "prompts": f"[{chats},{texts}]", "chats": str(chats), "model": str(model)}
    ray.shutdown()


def _overrides(assets, output: str, *extra: str) -> list[str]:
    return ["recipe=tiny_cpu_grpo", "actor_rollout_ref.model.init=pretrained",
            f"actor_rollout_ref.model.path={assets['model']}", f"data.path={assets['prompts']}",  # verl's names
            f"data.output_path={output}", "data.max_prompt_length=48", "data.max_response_length=12",
            "trainer.logger=[console]", "trainer.n_cpu_ranks=1", "actor_rollout_ref.actor.parallel.tp=1", *extra]


def test_greedy_responses_equal_transformers_generate_and_rows_come_back(assets):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output = assets["root"] / "greedy.jsonl"
    cfg = load_config(_overrides(assets, str(output), "data.n_samples=1", "data.batch_size=2",
                                 "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.do_sample=false"),
                      generation_only=True)  # greedy: refused for GRPO training, fine for generation
    summary = generate_responses(cfg, console=lambda *_: None)
    assert (summary.prompts, summary.responses, summary.prompts_dropped) == (3, 3, 1)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["id"] for row in rows] == ["a", "c", "b"]  # the rows as read, the overlong one left out
    assert rows[2]["prompt"] == "What is 7 + 8?"

    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval()
    for row in rows:
        messages = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        assert row["responses"] == [expected], row["id"]
    assert len({row["responses"][0] for row in rows}) == 3  # the check compares different answers


def test_sampled_responses_are_seeded_and_the_count_follows_rollout_n(assets):
    outputs = []
    for name in ("one.parquet", "two.parquet"):
        output = assets["root"] / name
        generate_responses(load_config(_overrides(assets, str(output), "actor_rollout_ref.rollout.n=3",
                                                  "actor_rollout_ref.rollout.temperature=1.0",
                                                  f"data.path={assets['chats']}"), generation_only=True),
                           console=lambda *_: None)
        import pyarrow.parquet as pq

        outputs.append(pq.read_table(output).column("responses").to_pylist())
    assert [len(r) for r in outputs[0]] == [3, 3]
    assert outputs[0] == outputs[1]  # trainer.seed fixes the samples
    assert any(len(set(r)) > 1 for r in outputs[0])  # sampling, not greedy


def test_the_command_refuses_a_run_without_an_output_path_or_several_greedy_samples(assets, capsys):
    overrides = [o for o in _overrides(assets, "unused.jsonl") if not o.startswith("data.output_path=")]
    assert generate_main(overrides) == 2
    assert "generation.output_path is not set" in capsys.readouterr().err
    greedy = _overrides(assets, str(assets["root"] / "unused.jsonl"), "data.n_samples=3",
                        "actor_rollout_ref.rollout.temperature=0")
    assert generate_main(greedy) == 2
    assert "generation.n_samples=3 with greedy decoding" in capsys.readouterr().err
    mixed = _overrides(assets, str(assets["root"] / "mixed.parquet"))  # chat lists and strings in one column
    assert generate_main(mixed) == 2
    assert "cannot share one parquet schema" in capsys.readouterr().err


def test_the_output_never_replaces_an_input_or_an_existing_file_unasked(assets, capsys):
    """``data.output_path`` equal to ``data.path`` would rewrite the prompts, losing those a filter dropped: refused,
    as is any existing file unless ``generation.overwrite=true``; prompts that already hold responses (a previous
    output) are refused by name. All before Ray starts (the input files keep their bytes)."""
    before = Path(assets["chats"]).read_bytes()
    same = _overrides(assets, assets["chats"], f"data.path={assets['chats']}", "generation.overwrite=true")
    assert generate_main(same) == 2
    assert "is data.train_files[0], the prompts it reads: megarl-generate never writes over its input" in \
        capsys.readouterr().err
    assert Path(assets["chats"]).read_bytes() == before
    existing = assets["root"] / "existing.jsonl"
    existing.write_text("keep me\n")
    assert generate_main(_overrides(assets, str(existing), f"data.path={assets['chats']}")) == 2
    assert f"generation.output_path={existing} exists: set generation.overwrite=true" in capsys.readouterr().err
    assert existing.read_text() == "keep me\n"
    answered = assets["root"] / "answered.jsonl"
    answered.write_text(json.dumps({"prompt": "What is 1 + 1?", "responses": ["2"]}) + "\n")
    assert generate_main(_overrides(assets, str(assets["root"] / "again.jsonl"), f"data.path={answered}")) == 2
    assert "the rows already have a 'responses' column" in capsys.readouterr().err
