"""Reward functions of the end-to-end tests (verl's signature)."""


def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    """The share of digits among the response's characters: varies within every GRPO group."""
    if not solution_str:
        return 0.0
    return sum(c.isdigit() for c in solution_str) / len(solution_str)


def overflow_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A finite score so large that a group's float32 mean overflows: the advantages, hence the loss, become NaN;
    the update must be skipped. (A non-finite score itself is refused by the reward manager.)"""
    return 3e38


def even_prompts_raise(data_source, solution_str, ground_truth, extra_info=None):
    """Raises on prompts with an even index (a judge that fails on some rows); digit share on the others."""
    if extra_info["index"] % 2 == 0:
        raise ConnectionError(f"judge unavailable for prompt {extra_info['index']}")
    return digit_share(data_source, solution_str, ground_truth, extra_info)


def flat_on_even_prompts(data_source, solution_str, ground_truth, extra_info=None):
    """The same score for every sample of a prompt with an even index (a group without signal, which dynamic
    sampling leaves out); digit share on the others. Extras: ``acc`` (the score) and the prompt's index."""
    index = extra_info["index"]
    score = 0.5 if index % 2 == 0 else digit_share(data_source, solution_str, ground_truth, extra_info)
    return {"score": score, "acc": score, "prompt_index": index}


async def digit_share_async(data_source, solution_str, ground_truth, extra_info=None):
    """``digit_share`` as an ``async def`` (an LLM judge or a sandbox would await I/O here)."""
    import asyncio

    await asyncio.sleep(0)
    return digit_share(data_source, solution_str, ground_truth, extra_info)


def judge_verdict(text):
    """A generative judge's verdict parser (``reward_model.judge.verdict_parser``) for a judge of random weights: its
    answer's length mod 11, and no verdict (garbage) when the length is a multiple of 3."""
    return None if len(text) % 3 == 0 else len(text) % 11
