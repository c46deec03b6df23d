"""Rewards: GSM8K and addition scorers, the data_source registry, custom functions, the manager.

The manager tests use the byte-level tokenizer of test_dataset (one token per byte), so a
response "82" followed by <|im_end|> is 3 tokens and its score sits at position 2.
"""

import logging
import threading

import numpy as np
import pytest
import torch

from megarl.data import Batch
from megarl.reward import RewardManager, ScorerRegistry, addition, default_compute_score, gsm8k, load_function
from megarl.reward.manager import OverlongPenalty, RewardError, last_valid_positions
from tests.unit.test_dataset import IM_END_ID, PAD_ID, build_tokenizer

# ------------------------------------------------------------------------------------------ GSM8K

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("text, strict, flexible", [
    (GSM8K_SOLUTION, "72", "72"),
    ("so the total is #### 1,234", "1234", "1234"),
    ("first #### 3 then corrected #### 4", "4", "4"),
    ("The answer is 18.", None, "18"),
    ("#### -7", "-7", "-7"),
    ("It costs 3.5 dollars, about 2 in total .", None, "2"),
    ("I think #### 12.", "12", "12"),
    ("no numbers at all", None, None),
    ("#### 5" + "x" * 300, None, "5"),
])
def test_gsm8k_extraction(text, strict, flexible):
    assert gsm8k.extract_solution(text, "strict") == strict
    assert gsm8k.extract_solution(text, "flexible") == flexible


def test_gsm8k_strict_only_reads_the_last_300_characters():
    assert gsm8k.extract_solution("x" * 294 + "#### 42") == "42"   # '####' starts at char 294 of 301
    assert gsm8k.extract_solution("#### 42" + "x" * 293) == "42"   # exactly 300 characters
    assert gsm8k.extract_solution("#### 42" + "x" * 294) is None   # the clip cuts the first '#'
    with pytest.raises(ValueError, match=r"method 'fuzzy' is unknown"):
        gsm8k.extract_solution("#### 1", "fuzzy")


def test_gsm8k_ground_truth_from_published_answers():
    assert gsm8k.extract_ground_truth(GSM8K_SOLUTION) == "72"
    assert gsm8k.extract_ground_truth("He pays 2*800 = 1,600\n#### 1,600") == "1600"
    assert gsm8k.extract_ground_truth("no final line") is None


def test_gsm8k_compute_score_and_format_score():
    assert gsm8k.compute_score(GSM8K_SOLUTION, "72") == 1.0
    assert gsm8k.compute_score("#### 71", "72") == 0.0
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("The answer is 72", "72", format_score=0.1) == 0.0      # strict: no answer
    assert gsm8k.compute_score("The answer is 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("#### 72.00", "72") == 1.0                                # same decimal
    assert gsm8k.compute_score("#### 72", "72", score=2.0) == 2.0
    assert gsm8k.score_response("#### 71", "72", format_score=0.1) == {"score": 0.1, "acc": 0.0, "pred": "71"}
    assert gsm8k.score_response("nothing", "72") == {"score": 0.0, "acc": 0.0, "pred": ""}


# --------------------------------------------------------------------------------------- addition

@pytest.mark.parametrize("text, score, pred", [
    ("82", 1.0, "82"), ("37 + 45 = 82", 1.0, "82"), ("82 is not 37 + 45", 0.0, "45"),
    ("81", 0.0, "81"), ("I don't know", 0.0, ""), ("-82", 0.0, "-82"),
])
def test_addition_scores_the_final_integer(text, score, pred):
    assert addition.score_response(text, "82") == {"score": score, "acc": score, "pred": pred}


def test_addition_format_and_bad_ground_truth():
    assert addition.format_question(37, 45) == "What is 37 + 45?" and addition.format_answer(37, 45) == "82"
    with pytest.raises(ValueError, match=r"ground truth 'eighty' is not an integer"):
        addition.score_response("80", "eighty")


# --------------------------------------------------------------------------------------- registry

def test_registry_dispatches_by_data_source():
    registry = ScorerRegistry()
    assert {"addition", "openai/gsm8k", "lighteval/MATH", "aime*"} <= set(registry.names())
    assert registry.compute_score("openai/gsm8k", "#### 72", "72")["score"] == 1.0
    assert registry.compute_score("addition", "5", "5")["acc"] == 1.0
    assert default_compute_score("addition", "6", "5")["score"] == 0.0
    with pytest.raises(ValueError, match=r"no reward scorer is registered for data_source 'math500'; "
                                         r"registered: \['DigitalLearningGmbH/MATH-lighteval', .*'addition', "
                                         r"'aime\*', .*'openai/gsm8k', .*'searchR1_triviaqa', 'squares'\]"):
        registry.get("math500")


def test_registry_register_and_configure():
    registry = ScorerRegistry()
    def length(solution_str, ground_truth, extra_info=None, scale=1.0):
        return scale * len(solution_str)

    registry.register("length", length, scale=0.5)
    assert registry.compute_score("length", "abcd", None) == 2.0
    with pytest.raises(ValueError, match=r"'length' already has a scorer; pass overwrite=True"):
        registry.register("length", len)
    registry.configure("openai/gsm8k", method="flexible")
    assert registry.compute_score("openai/gsm8k", "answer: 72", "72")["score"] == 1.0
    # Each registry is its own: a fresh one is still strict.
    assert ScorerRegistry().compute_score("openai/gsm8k", "answer: 72", "72")["score"] == 0.0


# ------------------------------------------------------------------------------- custom functions

CUSTOM_SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str.strip() == ground_truth) + bonus, "source": data_source,
            "tools": (extra_info or {}).get("reward_scores")}

LIMIT = 3
'''


def test_load_function_from_dotted_module_and_file(tmp_path):
    assert load_function("megarl.reward.gsm8k:compute_score") is gsm8k.compute_score
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_SOURCE)
    fn = load_function(f"{path}:compute_score", bonus=0.5)
    assert fn(data_source="d", solution_str="1", ground_truth="1")["score"] == 1.5
    # Loading twice gives the same module's function.
    assert load_function(f"{path}:compute_score") is load_function(f"{path}:compute_score")


def test_load_function_errors_name_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match=r"must look like 'module_or_path:function'"):
        load_function("megarl.reward.gsm8k")
    with pytest.raises(FileNotFoundError, match=r"file '.*absent.py' does not exist"):
        load_function(f"{tmp_path}/absent.py:compute_score")
    with pytest.raises(ValueError, match=r"module 'no_such_pkg.rewards' cannot be imported"):
        load_function("no_such_pkg.rewards:compute_score")
    with pytest.raises(ValueError, match=r"'megarl.reward.gsm8k' defines no 'score_fn'; its public callables are "
                                         r"\[.*'compute_score'.*\]"):
        load_function("megarl.reward.gsm8k:score_fn")
    path = tmp_path / "consts.py"
    path.write_text(CUSTOM_SOURCE)
    with pytest.raises(TypeError, match=r"'LIMIT' is a int, not a function"):
        load_function(f"{path}:LIMIT")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_installed_dependency\n")
    # A missing import inside an existing file is not dressed up as a naming mistake.
    with pytest.raises(ModuleNotFoundError, match=r"not_installed_dependency"):
        load_function(f"{broken}:f")


# --------------------------------------------------------------------------------------- manager

@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def response_batch(tokenizer, texts, num_tokens=8, data_sources=None, ground_truths=None, **non_tensors):
    """Right-padded responses ``text + <|im_end|>`` ('' -> no tokens) with their response_mask."""
    responses = torch.full((len(texts), num_tokens), PAD_ID)
    mask = torch.zeros((len(texts), num_tokens), dtype=torch.long)
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [IM_END_ID] if text else []
        responses[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, :len(ids)] = 1
    return Batch.from_dict({"responses": responses, "response_mask": mask,
                            "data_source": data_sources or ["addition"] * len(texts),
                            "reward_model": [{"style": "rule", "ground_truth": g} for g in ground_truths],
                            "extra_info": [{"index": i} for i in range(len(texts))], **non_tensors})


def test_manager_puts_each_score_on_the_last_valid_token(tokenizer):
    batch = response_batch(tokenizer, ["82", "= 82", "#### 72", "#### 7"], num_tokens=8,
                           data_sources=["addition", "addition", "openai/gsm8k", "openai/gsm8k"],
                           ground_truths=["82", "81", "72", "72"])
    scores, info = RewardManager(tokenizer)(batch)
    # Lengths with <|im_end|>: 3, 5, 8, 7 -> last valid positions 2, 4, 7, 6.
    expected = torch.zeros(4, 8)
    expected[0, 2], expected[2, 7] = 1.0, 1.0
    assert scores.dtype == torch.float32 and torch.equal(scores, expected)
    assert info == {"score": [1.0, 0.0, 1.0, 0.0], "acc": [1.0, 0.0, 1.0, 0.0], "pred": ["82", "82", "72", "7"]}


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_an_async_reward_function_is_awaited(tokenizer, timeout_s):
    """verl accepts ``async def compute_score`` (a judge or a sandbox awaiting I/O); it used to load and then fail
    at the first scored step ("returned coroutine"). With and without the time limit's thread."""
    import asyncio

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return {"score": float(solution_str == ground_truth), "judge": "async"}

    batch = response_batch(tokenizer, ["82", "81"], ground_truths=["82", "82"])
    scores, info = RewardManager(tokenizer, compute_score=compute_score, timeout_s=timeout_s)(batch)
    assert scores.sum(-1).tolist() == [1.0, 0.0] and info["judge"] == ["async", "async"]


def test_dapo_overlong_penalty_lowers_long_responses_scores(tokenizer):
    """verl's dapo reward manager's overlong buffer (reward_model.overlong_buffer): lengths 3, 5, 8, 7 of 8 with a
    buffer of 4 tokens lose 0, 1/4, 1 and 3/4 of penalty_factor=2 on their last token; the score extra stays the
    function's own, and ``log`` adds the penalty and whether there was one."""
    batch = response_batch(tokenizer, ["82", "= 82", "#### 72", "#### 7"], num_tokens=8,
                           data_sources=["addition", "addition", "openai/gsm8k", "openai/gsm8k"],
                           ground_truths=["82", "81", "72", "72"])
    overlong = OverlongPenalty(max_response_length=8, buffer_len=4, penalty_factor=2.0, log=True)
    scores, info = RewardManager(tokenizer, overlong=overlong)(batch)
    expected = torch.zeros(4, 8)
    expected[0, 2], expected[1, 4], expected[2, 7], expected[3, 6] = 1.0, -0.5, 1.0 - 2.0, -1.5
    assert torch.allclose(scores, expected)
    assert info["score"] == [1.0, 0.0, 1.0, 0.0] and info["overlong_reward"] == [-0.0, -0.5, -2.0, -1.5]
    assert info["overlong"] == [False, True, True, True]


def test_last_valid_positions_and_empty_responses(tokenizer, caplog):
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]])
    assert last_valid_positions(mask).tolist() == [1, -1, 3, 2]
    batch = response_batch(tokenizer, ["5", ""], num_tokens=4, ground_truths=["5", "5"])
    with caplog.at_level(logging.WARNING, logger="megarl.reward.manager"):
        scores, info = RewardManager(tokenizer, scorer_kwargs=None)(batch)
    assert scores.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert info["pred"] == ["5", ""] and "1 of 2 rows have no valid response token (rows [1])" in caplog.text


def test_manager_falls_back_to_attention_mask_and_passes_rm_scores(tokenizer):
    batch = response_batch(tokenizer, ["12", "3"], num_tokens=4, ground_truths=["12", "4"])
    response_mask = batch.pop("response_mask")["response_mask"]
    batch["attention_mask"] = torch.cat([torch.ones(2, 3, dtype=torch.long), response_mask], dim=1)
    scores, _ = RewardManager(tokenizer)(batch)
    assert scores.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    batch["rm_scores"] = torch.full((2, 4), 0.25)
    scores, info = RewardManager(tokenizer)(batch)
    assert torch.equal(scores, torch.full((2, 4), 0.25)) and info == {}
    with pytest.raises(ValueError, match=r"needs `attention_mask` \[B, P\+T\] or `response_mask` \[B, T\]"):
        RewardManager(tokenizer)(Batch.from_dict({"responses": torch.zeros(1, 2, dtype=torch.long),
                                                  "data_source": ["addition"],
                                                  "reward_model": [{"ground_truth": "1"}]}))


def test_manager_with_custom_function_spec_and_passed_through_tool_rewards(tokenizer, tmp_path):
    path = tmp_path / "custom_reward.py"
    path.write_text(CUSTOM_SOURCE)
    batch = response_batch(tokenizer, ["7", "8"], num_tokens=3, data_sources=["anything", "else"],
                           ground_truths=["7", "7"], reward_scores=[{"calc": 1.0}, {"calc": 0.0}])
    manager = RewardManager(tokenizer, compute_score=f"{path}:compute_score", reward_kwargs={"bonus": 0.5})
    scores, info = manager(batch)
    assert scores.tolist() == [[0.0, 1.5, 0.0], [0.0, 0.5, 0.0]]
    assert info == {"score": [1.5, 0.5], "source": ["anything", "else"], "tools": [{"calc": 1.0}, {"calc": 0.0}]}


def test_manager_scorer_kwargs_float_results_and_uneven_keys(tokenizer):
    batch = response_batch(tokenizer, ["71", "#### 72", "#### 70"], num_tokens=8,
                           data_sources=["openai/gsm8k", "openai/gsm8k", "addition"], ground_truths=["72", "72", "70"])
    manager = RewardManager(tokenizer, scorer_kwargs={"openai/gsm8k": {"method": "flexible", "format_score": 0.1}})
    scores, info = manager(batch)
    assert scores.sum(1).tolist() == pytest.approx([0.1, 1.0, 1.0])
    registry = ScorerRegistry()
    registry.register("openai/gsm8k", lambda s, g, e=None: 0.5 if "####" in s else 0, overwrite=True)
    scores, info = RewardManager(tokenizer, scorers=registry)(batch)
    # Float results give only "score"; the addition row's dict adds keys the others lack (None there).
    assert info == {"score": [0.0, 0.5, 1.0], "acc": [None, None, 1.0], "pred": [None, None, "70"]}
    assert scores[1, 7] == 0.5


def test_manager_errors_name_the_row(tokenizer):
    batch = response_batch(tokenizer, ["1"], num_tokens=2, ground_truths=["1"])
    batch["reward_model"] = np.array([{"style": "rule"}], dtype=object)
    with pytest.raises(ValueError, match=r"row 0 \(data_source 'addition'\): reward_model must be a dict with "
                                         r"'ground_truth'"):
        RewardManager(tokenizer)(batch)
    no_score = response_batch(tokenizer, ["1"], num_tokens=2, ground_truths=["1"])
    with pytest.raises(RewardError, match=r"row 0 .*returned a dict without 'score' \(keys \['acc'\]\)"):
        RewardManager(tokenizer, compute_score=lambda **kw: {"acc": 1.0})(no_score)
    with pytest.raises(RewardError, match=r"returned str; return a float or a dict"):
        RewardManager(tokenizer, compute_score=lambda **kw: "good")(no_score)
    with pytest.raises(ValueError, match=r"reward_kwargs are bound to a custom reward function, but none is set"):
        RewardManager(tokenizer, reward_kwargs={"bonus": 1})
    with pytest.raises(ValueError, match=r"no reward scorer is registered for data_source 'mystery'"):
        RewardManager(tokenizer)(response_batch(tokenizer, ["1"], num_tokens=2, data_sources=["mystery"],
                                                ground_truths=["1"]))


def test_manager_logs_num_examine_samples_per_data_source(tokenizer, caplog):
    batch = response_batch(tokenizer, ["1", "2", "3"], num_tokens=2, ground_truths=["1", "2", "3"])
    with caplog.at_level(logging.INFO, logger="megarl.reward.manager"):
        RewardManager(tokenizer, num_examine=1)(batch)
    assert caplog.text.count("[response]") == 1 and "[ground_truth] 1" in caplog.text


# ------------------------------------------------------------------------- scoring errors

def _source(tmp_path, text, name="reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("value", ["float('nan')", "float('inf')", "-float('inf')", "{'score': float('inf')}"])
def test_non_finite_scores_are_refused(tokenizer, tmp_path, value):
    """inf used to be accepted (every update then skipped, rc 0) while NaN was refused: both are refused."""
    spec = _source(tmp_path, f"def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                             f"    return {value}\n") + ":score"
    batch = response_batch(tokenizer, ["1", "2"], num_tokens=2, ground_truths=["1", "2"], index=[5, 6])
    with pytest.raises(RewardError, match=r"^row 0 \(prompt index 5, data_source 'addition'\): custom reward "
                                          r"function '.*reward.py:score' returned the score -?(nan|inf); scores must "
                                          r"be finite; fix the function, or set reward_model.on_error=skip"):
        RewardManager(tokenizer, compute_score=spec)(batch)


def test_a_raising_function_names_the_row_its_source_and_the_function_or_is_skipped_and_counted(tokenizer, tmp_path):
    spec = _source(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                             "    if solution_str == '2':\n"
                             "        raise KeyError('no judge for ' + solution_str)\n"
                             "    return float(solution_str == ground_truth)\n") + ":score"
    batch = response_batch(tokenizer, ["1", "2", "3"], num_tokens=2, ground_truths=["1", "2", "4"],
                           data_sources=["addition", "openai/gsm8k", "addition"], index=[10, 11, 12])
    with pytest.raises(RewardError, match=r"^row 1 \(prompt index 11, data_source 'openai/gsm8k'\): custom reward "
                                          r"function '.*reward.py:score' raised KeyError: 'no judge for 2'; fix the "
                                          r"function, or set reward_model.on_error=skip"):
        RewardManager(tokenizer, compute_score=spec)(batch)
    scores, info = RewardManager(tokenizer, compute_score=spec, on_error="skip")(batch)
    assert scores.sum(-1).tolist() == [1.0, 0.0, 0.0]
    assert info["score"] == [1.0, 0.0, 0.0]
    assert info["reward_error"][0] is None and info["reward_error"][2] is None
    assert info["reward_error"][1].startswith("row 1 (prompt index 11, data_source 'openai/gsm8k'): custom reward "
                                              "function") and info["reward_error"][1].endswith("raised KeyError: "
                                                                                               "'no judge for 2'")
    with pytest.raises(ValueError, match=r"reward_model.on_error='ignore'; use one of \('raise', 'skip'\)"):
        RewardManager(tokenizer, on_error="ignore")


def test_signature_and_return_annotation_are_checked_when_loaded(tokenizer, tmp_path):
    two_args = _source(tmp_path, "def score(text, answer):\n    return 1.0\n", "two.py") + ":score"
    with pytest.raises(ValueError, match=r"custom reward function '.*two.py:score' cannot be called as "
                                         r"fn\(data_source=\.\.\., solution_str=\.\.\., ground_truth=\.\.\., "
                                         r"extra_info=\.\.\.\) \(.*\); its signature is \(text, answer\)"):
        RewardManager(tokenizer, compute_score=two_args)
    kwargs = _source(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                               "    return 1.0\n", "kw.py") + ":score"
    with pytest.raises(ValueError, match=r"cannot be called as fn\(.*extra_info=\.\.\., bonus=\.\.\.\)"):
        RewardManager(tokenizer, compute_score=kwargs, reward_kwargs={"bonus": 1.0})
    for annotation, accepted in (("str", False), ("float | None", False), ("list[float]", False), ("float", True),
                                 ("dict[str, float]", True), ("float | dict", True), ("int", True)):
        spec = _source(tmp_path, f"def score(data_source, solution_str, ground_truth, extra_info=None) -> "
                                 f"{annotation}:\n    return 1.0\n", f"a{abs(hash(annotation))}.py") + ":score"
        if accepted:
            RewardManager(tokenizer, compute_score=spec)
        else:
            with pytest.raises(ValueError, match=r"is annotated to return .*; a reward function returns a float or "
                                                 r"a dict with 'score'"):
                RewardManager(tokenizer, compute_score=spec)


def test_data_sources_without_a_scorer_are_refused_up_front(tokenizer):
    manager = RewardManager(tokenizer)
    manager.check_data_sources(["addition", "openai/gsm8k"], "data.train_files")
    with pytest.raises(ValueError, match=r"data.val_files: rows of data_source \['mystery'\] have no reward scorer "
                                         r"\(registered: \[.*'addition'.*\]\); set reward_model.custom_reward_function"):
        manager.check_data_sources(["addition", "mystery"], "data.val_files")
    RewardManager(tokenizer, compute_score=lambda **kw: 1.0).check_data_sources(["mystery"], "data.train_files")


def test_numpy_and_tensor_scores_are_numbers(tokenizer):
    """Scores of numpy's types (np.float32, np.int64, np.bool_, 0-d arrays) and one-element tensors are numbers;
    a string, a two-element array or a complex number is not."""
    returns = [np.float32(0.5), np.int64(1), np.bool_(True), np.array(0.25), {"score": np.float16(2.0)},
               torch.tensor([0.75]), True]
    batch = response_batch(tokenizer, ["1"] * len(returns), num_tokens=3, ground_truths=["1"] * len(returns))
    registry = ScorerRegistry()
    registry.register("addition", lambda s, g, e=None: returns[e["index"]], overwrite=True)
    scores, info = RewardManager(tokenizer, scorers=registry)(batch)
    assert info["score"] == [0.5, 1.0, 1.0, 0.25, 2.0, 0.75, 1.0]
    assert scores.sum(1).tolist() == info["score"]
    for bad, shown in [("0.5", "str"), (np.array([1.0, 2.0]), "ndarray"), (1j, "complex"),
                       ({"score": "1"}, "a score of type str")]:
        registry.register("addition", lambda s, g, e=None, bad=bad: bad, overwrite=True)
        with pytest.raises(RewardError, match=f"row 0 .*returned .*{shown}"):
            RewardManager(tokenizer, scorers=registry)(response_batch(tokenizer, ["1"], num_tokens=3,
                                                                      ground_truths=["1"]))


def test_a_reward_function_past_its_time_limit_is_named_with_its_row(tokenizer):
    """Row 1's function never returns: with ``on_error=raise`` the step stops naming row 1 and the limit; with
    ``skip`` the row scores 0 (counted by the caller from ``reward_error``) and the rows after it are scored
    on a new thread. The stuck calls are released at the end (they would otherwise wait forever, on daemon
    threads that do not hold the process)."""
    release = threading.Event()
    registry = ScorerRegistry()
    registry.register("addition", lambda s, g, e=None: release.wait() if e["index"] == 1 else 0.5, overwrite=True)
    batch = response_batch(tokenizer, ["1", "2", "3"], num_tokens=3, ground_truths=["1", "2", "3"])
    try:
        with pytest.raises(RewardError, match=r"row 1 \(prompt index 1, data_source 'addition'\): the registered "
                                              r"scorer did not return within 2 s \(reward_model.timeout_s\)"):
            RewardManager(tokenizer, scorers=registry, timeout_s=2.0)(batch)
        manager = RewardManager(tokenizer, scorers=registry, timeout_s=2.0, on_error="skip")
        scores, info = manager(batch)
        assert info["score"] == [0.5, 0.0, 0.5] and scores.sum().item() == 1.0
        assert info["reward_error"][1].endswith("its call was left running on a thread of its own")
        assert info["reward_error"][0] is None and info["reward_error"][2] is None
        assert manager._bounded.abandoned_calls == 1
    finally:
        release.set()
    with pytest.raises(ValueError, match=r"reward_model.timeout_s must be > 0"):
        RewardManager(tokenizer, timeout_s=0)


def test_the_score_goes_on_the_last_token_of_the_response_tool_outputs_included(tokenizer):
    """``response_mask`` is the tokens that train (0 on a multi-turn rollout's tool outputs); the score goes on the
    response's last token by the attention mask, as verl places it, even when that token is a tool output."""
    batch = response_batch(tokenizer, ["7", "8"], num_tokens=5, ground_truths=["7", "7"])
    every_token = batch["response_mask"].clone()
    every_token[0, 3] = 1  # row 0 ends with a token the model did not generate (a tool output)
    batch["prompts"] = torch.ones(2, 2, dtype=torch.long)
    batch["attention_mask"] = torch.cat([torch.ones(2, 2, dtype=torch.long), every_token], dim=1)
    registry = ScorerRegistry()
    registry.register("addition", lambda s, g, e=None: 0.5, overwrite=True)
    scores, _ = RewardManager(tokenizer, scorers=registry)(batch)
    assert scores.nonzero().tolist() == [[0, 3], [1, 1]]  # row 1: "8" and <|im_end|>
