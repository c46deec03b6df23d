"""Reward functions of the end-to-end tests (verl's signature)."""


def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    """The share of digits among the response's characters: varies within every GRPO group."""
    if not solution_str:
        return 0.0
    return sum(c.isdigit() for c in solution_str) / len(solution_str)


def overflow_reward(data_source, solution_str, ground_truth, extra_info=None):
    """An overflowed score (inf): the group's advantages, hence the loss, become NaN; the update must be skipped."""
    return float("inf")
