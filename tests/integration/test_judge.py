"""A generative judge: its settings, its template and parsers, and a :class:`Judge` asking a real CPU engine
server behind a real sglang-router: verdicts equal to what the engine answers, garbage counted, time-outs counted
(requests held at the engine's step gate: they cannot finish, whatever the machine's speed), the concurrency bound,
and the share of failures that stops a run."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megarl.config import load_config
from megarl.config.judge import JudgeConfig, JudgeModelSource, JudgeRolloutConfig
from megarl.controller.judge import FAILURES, Judge, JudgeError, JudgeRow, JudgeSource, judge_rows, judge_step_metrics
from megarl.controller.reward_sources import RuleSource
from megarl.controller.reward_stage import RewardStage
from megarl.data.batch import Batch
from megarl.engines.event_loop import run_sync
from megarl.reward import RewardManager
from megarl.reward.manager import last_valid_positions
from megarl.reward.verdicts import (
    DEFAULT_TEMPLATE,
    GarbageVerdict,
    boxed,
    check_template,
    fill_template,
    last_number,
    load_parser,
    score_tag,
    yes_no,
)
from tests.engine_servers import engine_servers, get_json, load, set_step_gate, wait_for, wait_held_at_gate

R = "recipe=tiny_cpu_grpo"
J = "reward_model.judge"


# ---------------------------------------------------------------------------------------------- parsers and template

def test_the_built_in_parsers_read_the_last_verdict_and_refuse_garbage():
    assert score_tag("first <score>3</score>, on reflection <score> 8.5 </score>") == 8.5
    assert last_number("Score: 7 out of 10") == 10.0 and last_number("-2.5 points") == -2.5
    assert boxed(r"so \boxed{4} then \boxed{ 9 }") == 9.0
    assert yes_no("No... wait, Yes.") == 1.0 and yes_no("yes? no") == 0.0
    for parser, text in ((score_tag, "score: 7"), (last_number, "no digits"), (boxed, "boxed 4"),
                         (yes_no, "maybe, yesterday")):
        with pytest.raises(GarbageVerdict, match="in the judge's answer"):
            parser(text)


def test_a_custom_parser_is_loaded_by_path_and_none_is_garbage(tmp_path):
    path = tmp_path / "parse.py"
    path.write_text("def parse(text):\n    return None if 'x' in text else len(text)\n")
    parse = load_parser(f"{path}:parse", "key")
    assert parse("abc") == 3.0
    with pytest.raises(GarbageVerdict, match="found no verdict"):
        parse("xyz")
    with pytest.raises(ValueError, match=r"key='nope': use one of \['boxed', 'last_number', 'score_tag', 'yes_no'\]"):
        load_parser("nope", "key")


def test_templates_name_only_what_a_row_has_and_always_the_response():
    check_template(DEFAULT_TEMPLATE, "k")
    check_template("{prompt} {response} {extra_info[question]} {data_source}", "k")
    with pytest.raises(ValueError, match=r"k names \{solution\}"):
        check_template("{prompt} {solution}", "k")
    with pytest.raises(ValueError, match=r"never names \{response\}"):
        check_template("{prompt}", "k")
    with pytest.raises(ValueError, match="not a format string"):
        check_template("{response", "k")
    text = fill_template("Q: {prompt} A: {response} ({ground_truth}, {extra_info[question]})", prompt="p",
                         response="r", ground_truth=3, data_source="d", extra_info={"question": "q"})
    assert text == "Q: p A: r (3, q)"


@pytest.mark.parametrize("overrides, message", [
    ([f"{J}.enable=true", f"{J}.model.path=/m"], f"{J}.enable=true needs {J}.pool_nodes"),
    ([f"{J}.enable=true", f"{J}.pool_nodes=[1]"], f"{J}.enable=true needs {J}.model.path"),
    ([f"{J}.enable=true", f"{J}.model.path=/m", f"{J}.pool_nodes=[1]", f"{J}.verdict_parser=vote"],
     f"{J}.verdict_parser='vote'"),
    ([f"{J}.score_range=[5,5]"], f"{J}.score_range=\\[5.0, 5.0\\]"),
    ([f"{J}.max_failure_share=1.5"], f"{J}.max_failure_share must be in"),
    ([f"{J}.combine=mean"], f"{J}.combine"),
    ([f"{J}.rollout.name=vllm"], f"{J}.rollout.name=vllm: megarl generates with SGLang"),
    ([f"{J}.rollout.temperature=-1"], f"{J}.rollout"),
    ([f"{J}.enable=true", f"{J}.model.path=/m", f"{J}.pool_nodes=[2]", f"{J}.rollout.tensor_model_parallel_size=2"],
     "the hf engine is one process per engine"),
    ([f"{J}.enable=true", f"{J}.model.path=/m", f"{J}.pool_nodes=[3]", f"{J}.rollout.name=sglang",
      f"{J}.rollout.tensor_model_parallel_size=2"], "does not divide the 3 GPUs"),
])
def test_judge_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(Exception, match=message):
        load_config([R, *overrides])


def test_a_judge_gets_its_own_pool_and_engines_in_the_plan():
    from megarl.plan.placement import placement_for

    cfg = load_config([R, f"{J}.enable=true", f"{J}.model.path=/m", f"{J}.pool_nodes=[1]"])
    plan = placement_for(cfg)
    assert plan.pools["judge"].nodes == (1,) and len(plan.judge_engines) == 1
    assert plan.judge_engines[0].pool == "judge" and plan.judge_engines[0].bundles == (0,)
    assert "judge: 1 engines of TP 1 on pool judge" in plan.describe()
    cfg = load_config([R, f"{J}.enable=true", f"{J}.model.path=/m", f"{J}.pool_nodes=[8,8]", f"{J}.rollout.name=sglang",
                       f"{J}.rollout.tensor_model_parallel_size=4"])
    engines = placement_for(cfg).judge_engines
    assert [e.bundles for e in engines] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert [e.node for e in engines] == [0, 0, 1, 1]
    assert placement_for(load_config([R])).judge_engines == ()


# ---------------------------------------------------------------------------------------------- counting failures

def _extra(errors, scores):
    return {"judge_error": errors, "judge_score": scores}


def test_step_metrics_count_each_failure_and_stop_past_the_share():
    errors = [None, "garbage: no <score>", "timeout: no answer", None, "too_long: 9 tokens", "error: 503", None, None]
    scores = [1.0, None, None, 0.5, None, None, 0.0, 0.5]
    metrics = judge_step_metrics(_extra(errors, scores), 0.5, "step 3")
    assert metrics == {"judge/num_verdicts": 4.0, "judge/failure_share": 0.5, "judge/num_timeout": 1.0,
                       "judge/num_garbage": 1.0, "judge/num_too_long": 1.0, "judge/num_error": 1.0,
                       "judge/score_mean": 0.5}
    with pytest.raises(JudgeError, match=r"step 3: the judge could not score 4 of 8 rows \(timeout 1, garbage 1, "
                                         r"too_long 1, error 1\), over reward_model.judge.max_failure_share=0.4; "
                                         r"the first: garbage: no <score>"):
        judge_step_metrics(_extra(errors, scores), 0.4, "step 3")
    assert judge_step_metrics(_extra([None], [0.2]), 0.0, "s", prefix="val-judge") == {
        "val-judge/num_verdicts": 1.0, "val-judge/failure_share": 0.0, "val-judge/score_mean": 0.2,
        **{f"val-judge/num_{kind}": 0.0 for kind in FAILURES}}


def test_failed_rows_are_counted_in_the_step(tmp_path):
    cfg = load_config([R, f"{J}.enable=true", f"{J}.model.path=/m", f"{J}.pool_nodes=[1]"])
    said = []
    stage = RewardStage([JudgeSource(Judge(cfg.reward_model.judge, None, None, seed=0), None)],
                        console=said.append)
    metrics = stage.failure_metrics(_extra([None, "timeout: t", None, "garbage: g"], [1.0, None, 0.0, None]), "step 1")
    assert metrics["judge/num_timeout"] == metrics["judge/num_garbage"] == 1.0 and metrics["judge/failure_share"] == 0.5
    assert said == ["step 1: 2 of 4 rows could not be scored by the judge and are left out of the update; the first: "
                    "timeout: t"]
    assert stage.unscored_keys == ["judge_error"]


# ---------------------------------------------------------------------------------------------- a real judge engine

@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    from megarl.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("judge") / "model", num_layers=1, seed=5)


@pytest.fixture(scope="module")
def servers(judge_model, tmp_path_factory):
    with engine_servers(judge_model, tmp_path_factory.mktemp("logs"), num_engines=1, router=True,
                        extra_args=["--enable-step-gate"]) as started:
        yield started


@pytest.fixture(scope="module")
def tokenizer(judge_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(judge_model))


def _config(tmp_path, **fields) -> JudgeConfig:
    """A judge's section: a verdict the engine's answer always holds (its length mod 11), unless ``fields`` say."""
    parse = tmp_path / "length_verdict.py"
    parse.write_text("def verdict(text):\n    return len(text) % 11\n")
    settings = dict(enable=True, model=JudgeModelSource(path=str(tmp_path)), pool_nodes=[1],
                    verdict_parser=f"{parse}:verdict", score_range=(0, 10),
                    prompt_template="Grade {response} for {prompt}",
                    timeout_s=60.0, rollout=JudgeRolloutConfig(temperature=1.0, response_length=6))
    return JudgeConfig(**{**settings, **fields})


def _rows(n: int) -> list[JudgeRow]:
    return [JudgeRow(prompt=f"What is {i} + 1?", response=str(i + 1), ground_truth=str(i + 1), data_source="addition",
                     extra_info=None, key=f"1-{i}/{i}") for i in range(n)]


def test_verdicts_are_what_the_engine_answers_each_row_seeded_by_its_key(servers, tokenizer, tmp_path):
    judge = Judge(_config(tmp_path), servers.generator, tokenizer, seed=11)
    rows = _rows(6)
    verdicts = judge.judge(rows)
    assert [v.failure for v in verdicts] == [None] * 6
    again = judge.judge(rows)
    assert [v.answer for v in again] == [v.answer for v in verdicts]  # seeded by the row's key: the same answers
    for row, verdict in zip(rows, verdicts):
        assert verdict.verdict == len(verdict.answer) % 11 and verdict.score == verdict.verdict / 10
    # The answer is the engine's own for the templated chat prompt (asked directly, with the judge's seed).
    import zlib

    from megarl.seeds import SEED_STREAM_JUDGE, derive_seed

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Grade 1 for What is 0 + 1?"}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    assert judge.prompt_ids("Grade 1 for What is 0 + 1?") == ids
    output = run_sync(servers.engines[0].generate(ids, judge.params, seed=derive_seed(11, SEED_STREAM_JUDGE,
                                                                                      zlib.crc32(b"1-0/0"))))
    assert verdicts[0].answer == tokenizer.decode(output.output_ids, skip_special_tokens=True)


def test_garbage_out_of_range_and_overlong_prompts_are_counted_failures(servers, tokenizer, tmp_path):
    garbage = Judge(_config(tmp_path, verdict_parser="score_tag"), servers.generator, tokenizer, seed=0)
    verdicts = garbage.judge(_rows(4))
    assert {v.failure for v in verdicts} == {"garbage"} and all("<score>N</score>" in v.message for v in verdicts)
    narrow = Judge(_config(tmp_path, score_range=(0, 0.5)), servers.generator, tokenizer, seed=0)
    verdicts = narrow.judge(_rows(4))
    for v in verdicts:
        assert (v.failure == "garbage" and "outside reward_model.judge.score_range [0, 0.5]" in v.message) \
            if v.verdict > 0.5 else v.failure is None
    short = Judge(_config(tmp_path, rollout=JudgeRolloutConfig(prompt_length=4, response_length=6)), servers.generator,
                  tokenizer, seed=0)
    (verdict,) = short.judge(_rows(1))
    assert verdict.failure == "too_long" and "over reward_model.judge.rollout.prompt_length=4" in verdict.message
    missing = Judge(_config(tmp_path, prompt_template="{response} {extra_info[question]}"), servers.generator,
                    tokenizer, seed=0)
    (verdict,) = missing.judge(_rows(1))
    assert verdict.failure == "error" and "'question'" in verdict.message


def test_at_most_max_concurrency_requests_wait_and_held_ones_time_out(servers, tokenizer, tmp_path):
    """The engine holds every batch at its first token: no request can finish, so each row times out; while they
    are held the engine has exactly ``max_concurrency`` requests (the judge sends no more)."""
    url = servers.processes[0].url
    judge = Judge(_config(tmp_path, max_concurrency=2, timeout_s=5.0), servers.generator, tokenizer, seed=0)

    async def scenario():
        await set_step_gate(url, 1)
        try:
            task = asyncio.ensure_future(judge.ajudge(_rows(3)))
            await wait_held_at_gate(url)
            loads = await wait_for(url, "/v1/loads", lambda a: load(a)["num_running_reqs"] + load(a)["num_waiting_reqs"]
                                   == 2, "had both allowed requests")
            assert load(loads)["num_running_reqs"] + load(loads)["num_waiting_reqs"] == 2
            verdicts = await task
            # The judge let go of them (its connections closed, through the router): the engine aborts them, though
            # its batch is still held at the gate (SGLang aborts a request whose client went away).
            await wait_for(url, "/v1/loads", lambda a: load(a)["num_running_reqs"] + load(a)["num_waiting_reqs"]
                           == 0, "aborted the requests the judge gave up on")
        finally:
            await set_step_gate(url, None)
        return verdicts

    verdicts = run_sync(scenario())
    assert [v.failure for v in verdicts] == ["timeout"] * 3
    assert verdicts[0].message == "no answer within reward_model.judge.timeout_s=5 s"
    # The gate lifted, the engine answers again.
    assert [v.failure for v in judge.judge(_rows(2))] == [None, None]
    assert run_sync(get_json(url, "/step_gate"))["hold_at"] is None


def test_the_judged_reward_replaces_or_adds_to_the_rule_score(servers, tokenizer, tmp_path):
    rows = 4
    prompts = torch.tensor([[0, 0, 5, 6]] * rows)
    ids = [tokenizer.encode(str(i + 1), add_special_tokens=False) for i in range(rows)]
    width = max(map(len, ids)) + 1
    responses = torch.full((rows, width), tokenizer.pad_token_id)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, row in enumerate(ids):
        responses[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    batch = Batch({"prompts": prompts, "responses": responses,
                   "attention_mask": torch.cat([torch.tensor([[0, 0, 1, 1]] * rows), mask], dim=1)},
                  non_tensors={"data_source": ["addition"] * rows,
                               "reward_model": [{"ground_truth": "1"}] * rows,
                               "raw_prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(rows)],
                               "uid": [f"1-{i // 2}" for i in range(rows)]})
    asked = judge_rows(batch, tokenizer, last_valid_positions(mask))
    assert [r.prompt for r in asked] == [f"What is {i} + 1?" for i in range(rows)]
    assert [r.response for r in asked] == [str(i + 1) for i in range(rows)]
    assert [r.key for r in asked] == ["1-0/0", "1-0/1", "1-1/2", "1-1/3"]
    rules = RuleSource(RewardManager(tokenizer))
    judge = Judge(_config(tmp_path), servers.generator, tokenizer, seed=3)
    stage = RewardStage([rules, JudgeSource(judge, tokenizer)])
    assert [s.name for s in stage.sources] == ["judge"]  # the rule function, replaced, is not called
    replaced, extra = stage.rollout_scores(batch)
    judged = extra["judge_score"]
    last = mask.sum(1) - 1
    assert replaced[torch.arange(rows), last].tolist() == pytest.approx(judged)
    assert replaced.sum().item() == pytest.approx(sum(judged))
    assert extra["score"] == judged and extra["judge_error"] == [None] * rows
    assert [len(a) % 11 for a in extra["judge_answer"]] == extra["judge_verdict"]
    added, extra = RewardStage([rules, JudgeSource(Judge(_config(tmp_path, combine="add", coef=0.5), servers.generator,
                                                         tokenizer, seed=3), tokenizer)]).rollout_scores(batch)
    rule = [1.0 if i == 0 else 0.0 for i in range(rows)]  # only row 0 answers the ground truth "1"
    assert added[torch.arange(rows), last].tolist() == pytest.approx([r + 0.5 * j for r, j in zip(rule, judged)])
    assert extra["acc"] == rule  # the rule function's own extras stay
