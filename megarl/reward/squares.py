"""The red-squares counting task of the tiny vision-language recipe: its prompt, its images and its scorer.

Format (shared by :mod:`megarl.warmstart.squares_data`, the tiny model's warm-up SFT and this scorer):

- an image of 2 × 4 cells of 14 × 14 pixels (28 × 56: two merged 28 × 28 patches of the tiny vision tower), each
  empty (white) or holding a 10 × 10 square, red, blue or green; 0 to :data:`MAX_RED` of the squares are red;
- the prompt is one user message, ``"<image>How many red squares?"`` (:data:`QUESTION`);
- the expected response is the number of red squares in decimal (``reward_model.ground_truth``);
- scoring: the last integer in the decoded response is the prediction; 1.0 when it equals the ground truth,
  0.0 otherwise (also when there is none), as the addition task scores.
"""

from __future__ import annotations

from typing import Any

from megarl.reward.addition import score_last_integer

DATA_SOURCE = "squares"
"""``data_source`` of the counting rows."""
QUESTION = "<image>How many red squares?"
"""The user message (``<image>``: where the image goes)."""
ROWS, COLUMNS, CELL, SQUARE = 2, 4, 14, 10
"""The image's grid of cells, a cell's and a square's side in pixels."""
MAX_RED = 4
"""The most red squares an image holds."""
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60)}
"""The squares' colours (RGB)."""


def score_response(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """Registered scorer for :data:`DATA_SOURCE`: ``{"score", "acc", "pred"}`` (1.0 when the last integer of the
    response is the number of red squares, else 0.0)."""
    return score_last_integer(solution_str, ground_truth, task="squares", rebuild="megarl.warmstart.squares_data")
