"""The built-in scorers against verl's rules (verl/utils/reward_score/*), and verl's data_source table.

Each case's expected score is what verl's own scorer returns for it (verl has no reference tests for these
scorers; the cases follow its implementations' rules, one per rule).
"""

from __future__ import annotations

import pytest

from megarl.reward import (
    RewardManager,
    ScorerRegistry,
    default_compute_score,
    geometry,
    gsm8k,
    hendrycks_math,
    math_dapo,
    prime_math,
    search_qa,
    verified_math,
)

# verl's default_compute_score table: data_source -> the megarl module that scores it.
VERL_TABLE = {
    "openai/gsm8k": gsm8k,
    "lighteval/MATH": hendrycks_math, "DigitalLearningGmbH/MATH-lighteval": hendrycks_math,
    "HuggingFaceH4/MATH-500": hendrycks_math,
    "math_dapo": math_dapo, "math": math_dapo, "math_dapo_reasoning": math_dapo,
    "aime2024": math_dapo, "aime_2025": math_dapo, "aime": math_dapo,
    **dict.fromkeys(["numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                     "numina_cn_k12", "numina_olympiads"], prime_math),
    "hiyouga/geometry3k": geometry,
    **dict.fromkeys(["searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"], search_qa),
}


@pytest.mark.parametrize("data_source", sorted(VERL_TABLE))
def test_the_default_table_scores_each_verl_data_source_with_its_scorer(data_source):
    assert ScorerRegistry().get(data_source) is VERL_TABLE[data_source].score_response


def test_a_data_source_without_a_scorer_is_refused_before_ray_naming_the_known_ones():
    manager = RewardManager(tokenizer=None)
    manager.check_data_sources(["aime2024", "lighteval/MATH", "searchR1_nq"], "data.train_files")
    with pytest.raises(ValueError, match=r"data.val_files: rows of data_source \['codecontests'\] have no reward "
                                         r"scorer \(registered: \[.*'aime\*', .*'hiyouga/geometry3k', .*'math_dapo'"):
        manager.check_data_sources(["aime2024", "codecontests"], "data.val_files")
    with pytest.raises(ValueError, match=r"no reward scorer is registered for data_source 'aim'"):
        default_compute_score("aim", "", "1")


def test_prefixes_yield_to_exact_names_and_longer_prefixes():
    registry = ScorerRegistry()
    registry.register("aime2025*", lambda solution_str, ground_truth, extra_info=None: 7.0)
    registry.register("aime2025_hard", lambda solution_str, ground_truth, extra_info=None: 9.0)
    assert registry.compute_score("aime2025_x", "", "1") == 7.0
    assert registry.compute_score("aime2025_hard", "", "1") == 9.0
    assert registry.compute_score("aime2024", "Answer: 1", "1")["score"] == 1.0
    registry.configure("aime2024", strict_box_verify=True)  # configures that source alone
    assert registry.compute_score("aime2024", "Answer: 1", "1")["score"] == -1.0
    assert registry.compute_score("aime2023", "Answer: 1", "1")["score"] == 1.0


# ------------------------------------------------------------------------------------ MATH (math_reward)

@pytest.mark.parametrize("response, truth, expected", [
    ("so the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),          # dfrac -> frac, \frac12 -> \frac{1}{2}
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),                # a/b -> \frac{a}{b}
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),                # 0.5 -> \frac{1}{2}
    ("\\boxed{.5}", "0.5", 1.0),                          # a leading 0
    ("\\boxed{x = 5}", "5", 1.0),                         # a short left side is dropped
    ("\\boxed{xyz = 5}", "5", 0.0),                       # ... a long one is not
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),                 # a right unit
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)", 1.0),
    ("\\boxed 7$ done", "7", 1.0),                        # "\boxed " up to the next $
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),       # the last box
    ("first \\boxed{3} then \\boxed{4}", "3", 0.0),
    ("\\fbox{4}", "4", 0.0),                              # an \fbox is found but never unboxed
    ("\\boxed{4", "4", 0.0),                              # never closed
    ("the answer is 4", "4", 0.0),                        # no box
    ("\\boxed{2\\sqrt}", "2\\sqrt", 1.0),                 # no normal form: raw equality
    ("\\boxed{2\\sqrt}", "2 \\sqrt", 0.0),
    ("\\boxed{4}", 4, 1.0),                               # a number as ground truth
])
def test_math_scores_like_verl(response, truth, expected):
    assert hendrycks_math.compute_score(response, truth) == expected
    result = default_compute_score("lighteval/MATH", response, truth)
    assert (result["score"], result["acc"]) == (expected, expected)


def test_math_strip_string_and_pred():
    assert hendrycks_math.strip_string("\\tfrac{3}{4}\\!") == "\\frac{3}{4}"
    assert hendrycks_math.strip_string("k = \\frac34") == "\\frac{3}{4}"
    assert hendrycks_math.strip_string("03/4") == "03/4"  # not canonical integers
    assert default_compute_score("HuggingFaceH4/MATH-500", "\\boxed{\\pi}", "3")["pred"] == "\\pi"
    assert default_compute_score("HuggingFaceH4/MATH-500", "no box", "3")["pred"] == ""


# ---------------------------------------------------------------------------------------- DAPO math

@pytest.mark.parametrize("response, truth, score, pred", [
    ("... so\nAnswer: 42", "42", 1.0, "42"),
    ("answer : 42\nmore text", "42", 1.0, "42"),                  # any case, spaces, to the end of the line
    ("Answer: 41\nAnswer: 42", "42", 1.0, "42"),                  # the last one
    ("Answer: $\\boxed{1,000}$ dollars", "1000", 1.0, "1000"),    # $..$, \boxed, dollars, digit commas
    ("Answer: x = \\frac34", "\\frac{3}{4}", 1.0, "\\frac{3}{4}"),
    ("Answer: \\text{(B)}", "(B)", 1.0, "(B)"),
    ("Answer: 5 units", "5", 1.0, "5"),
    ("Answer: 0.5", "\\frac{1}{2}", -1.0, "0.5"),                 # no numeric equivalence
    ("The result is \\boxed{42}", "42", -1.0, "[INVALID]"),       # no Answer: line
    ("Answer: 42" + " " * 300, "42", -1.0, "[INVALID]"),          # only the last 300 characters count
])
def test_dapo_math_scores_like_verl(response, truth, score, pred):
    result = default_compute_score("math_dapo", response, truth)
    assert result == {"score": score, "acc": float(score == 1.0), "pred": pred}
    assert default_compute_score("aime2024", response, truth) == result


def test_dapo_strict_box():
    assert math_dapo.compute_score("so \\boxed{42}", "42", strict_box_verify=True)["score"] == 1.0
    assert math_dapo.compute_score("so \\boxed{42.0}", "42", strict_box_verify=True)["score"] == -1.0
    assert math_dapo.compute_score("\\boxed{42}" + "." * 100, "42", strict_box_verify=True) == {
        "score": -1.0, "acc": 0.0, "pred": ""}
    assert math_dapo.compute_score("x" * 50 + "\\boxed{7}" + "p" * 200, "7", strict_box_verify=True,
                                   pause_tokens_index=[0, 1, 2, 150])["score"] == 1.0


# ------------------------------------------------------------------------------------ Search-R1 EM

@pytest.mark.parametrize("response, targets, score", [
    ("<think>..</think><answer> The Eiffel Tower! </answer>", ["eiffel tower"], 1.0),
    ("<answer>Paris</answer> then <answer>London</answer>", ["Paris"], 0.0),  # the last answer
    ("<answer>London</answer>", "london", 1.0),                               # one target string
    ("<answer>\nBarack   Obama\n</answer>", ["Obama", "barack obama"], 1.0),
    ("no tags, Paris", ["Paris"], 0.0),
    ("<answer>Paris</answer>" * 11, ["Paris"], 0.25),                         # too many tags
    ("<answer>Paris</answer>" * 10, ["Paris"], 1.0),
])
def test_search_exact_match_scores_like_verl(response, targets, score):
    assert default_compute_score("searchR1_nq", response, {"target": targets})["score"] == score


def test_search_format_score_and_substring_match():
    assert search_qa.compute_score("<answer>Rome</answer>", {"target": ["Paris"]}, format_score=0.2) == 0.2
    assert search_qa.compute_score("Paris", {"target": ["Paris"]}, format_score=0.2) == 0.0
    assert search_qa.score_response("<answer>city of Paris</answer>", {"target": ["paris"]}, subem=True)["score"] == 1.0
    assert search_qa.normalize_answer("The  Cat's, an apple.") == "cats apple"


# ------------------------------------------------------------------------- graded (math-verify) scorers

def test_math_verify_is_installed_for_the_tests():
    assert verified_math.verify_answer("The answer is $\\frac{2}{4}$", "\\frac{1}{2}") == 1.0
    assert verified_math.verify_answer("The answer is $3$", "\\frac{1}{2}") == 0.0
    assert verified_math.compute_score("lighteval/MATH", "$x = 0.5$", "\\frac{1}{2}") == {"score": 1.0, "acc": 1.0}


@pytest.mark.parametrize("response, truth, expected, pred", [
    ("Step 1: ... Step 2: so the answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ("Therefore the answer is 12. ", "12", 1.0, "12."),                  # after "answer is", text is graded
    ("We get x = 7", "7", 1.0, "7"),                                     # after the last "="
    ("5 is the answer", "5", 1.0, "5"),
    ("Answer: \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0, "2\\sqrt{2}"),     # equivalent, not equal
    ("Answer: \\boxed{0.5}", "\\frac{1}{2}", 1.0, "0.5"),
    ("Answer: \\boxed{\\text{(A)}}", "(A)", 1.0, "\\text{(A)}"),         # mathd: the enclosing \text{}
    ("Answer: \\boxed{13}", "12", 0.0, "13"),
    ("Answer: \\boxed{12.0}", "12", 1.0, "12.0"),
    ("Answer: \\boxed{\\frac{24}{2}}", "12", 0.0, "\\frac{24}{2}"),
])
def test_numina_scores_like_verl(response, truth, expected, pred):
    result = default_compute_score("numina_olympiads", response, truth)
    assert (result["score"], result["acc"], result["pred"]) == (expected, expected, pred)


@pytest.mark.parametrize("response, truth, expected", [
    ("<think>angles sum to 180</think> so \\boxed{30}", "30", 1.0),
    ("<think>x</think>\n\\boxed{\\sqrt{8}}\n", "2\\sqrt{2}", 1.0),
    ("<think>x</think> \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.1),      # a fraction only as itself
    ("<think>x</think>\n\\boxed{\\frac{60}{2}}\n", "30", 0.1),          # an integer takes only an integer
    ("so \\boxed{30}", "30", 0.9),                                        # right, without the format
    ("<think>x</think> \\boxed{31}", "30", 0.1),                          # the format only
    ("thirty", "30", 0.0),
])
def test_geometry_scores_like_verl(response, truth, expected):
    assert default_compute_score("hiyouga/geometry3k", response, truth)["score"] == pytest.approx(expected)
    assert geometry.extract_boxed_content("\\boxed{ {a} }") == "{a}" and geometry.extract_boxed_content("x") == "None"


def test_a_missing_math_verify_names_the_extra(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'megarl\[math\]'"):
        verified_math.verify_answer("1", "1")


def test_math_verify_runs_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(verified_math.verify_answer, "$\\frac{4}{8}$", "0.5").result() == 1.0


def test_verls_math_verify_option_loads_as_a_custom_reward_function():
    manager = RewardManager(tokenizer=None, compute_score="megarl.reward.verified_math:compute_score")
    assert manager.compute_score("lighteval/MATH", "so $\\frac{3}{6}$", "\\frac{1}{2}")["score"] == 1.0
