"""Synthetic red-squares counting prompts for the tiny vision-language recipe, in verl's image row schema.

Each row shows an image of coloured squares (:mod:`megarl.reward.squares` defines the task) and asks how many
are red. Rows:

- ``data_source``: ``"squares"``; ``ability``: ``"counting"``;
- ``prompt``: ``[{"role": "user", "content": "<image>How many red squares?"}]``;
- ``images``: ``[{"bytes": <PNG>, "path": None}]`` (verl's ``images`` column, as ``datasets`` stores images);
- ``reward_model``: ``{"style": "rule", "ground_truth": "3"}``;
- ``extra_info``: ``{"split", "index", "red", "others"}``.

Image ``i`` of a split is drawn with ``random.Random(f"{seed}-{split}-{i}")``: the same seed and sizes give the
same files. :func:`ensure_squares_data` is what a run calls to create the files it needs once.
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np

from megarl.reward.squares import CELL, COLOURS, COLUMNS, DATA_SOURCE, MAX_RED, QUESTION, ROWS, SQUARE
from megarl.warmstart.addition_data import _write_table_atomically

logger = logging.getLogger(__name__)

SQUARES_DATA_DIR = "data/squares"
"""Where the tiny vision-language recipe's data lives (relative to the run's directory)."""
SQUARES_DATA_FILES = ("train.parquet", "test.parquet")
"""The files :func:`ensure_squares_data` writes there."""


def draw(rng: random.Random) -> tuple[bytes, int, int]:
    """A PNG of ``ROWS × COLUMNS`` cells with 0..:data:`MAX_RED` red squares and some blue or green ones;
    ``(png, red, others)``."""
    from PIL import Image

    cells = ROWS * COLUMNS
    red = rng.randint(0, MAX_RED)
    others = rng.randint(0, cells - red)
    pixels = np.full((ROWS * CELL, COLUMNS * CELL, 3), 255, dtype=np.uint8)
    margin = (CELL - SQUARE) // 2
    for k, cell in enumerate(rng.sample(range(cells), red + others)):
        row, column = divmod(cell, COLUMNS)
        colour = COLOURS["red"] if k < red else COLOURS[rng.choice(["blue", "green"])]
        y, x = row * CELL + margin, column * CELL + margin
        pixels[y:y + SQUARE, x:x + SQUARE] = colour
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue(), red, others


def make_row(split: str, index: int, seed: int) -> dict[str, Any]:
    """Row ``index`` of ``split``."""
    png, red, others = draw(random.Random(f"{seed}-{split}-{index}"))
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": QUESTION}], "ability": "counting",
            "images": [{"bytes": png, "path": None}],
            "reward_model": {"style": "rule", "ground_truth": str(red)},
            "extra_info": {"split": split, "index": index, "red": red, "others": others}}


def ensure_squares_data(directory: str | Path, *, num_train: int = 2000, num_test: int = 200,
                        seed: int = 0) -> tuple[Path, Path]:
    """``(train_path, test_path)`` in ``directory``, writing whichever file is missing (atomically; files that
    exist are used as they are)."""
    if num_train < 1 or num_test < 1:
        raise ValueError(f"ensure_squares_data needs num_train >= 1 and num_test >= 1, got {num_train}, {num_test}")
    out = Path(directory).expanduser()
    paths = {"train": out / SQUARES_DATA_FILES[0], "test": out / SQUARES_DATA_FILES[1]}
    for split, count in (("train", num_train), ("test", num_test)):
        if paths[split].exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        _write_table_atomically([make_row(split, i, seed) for i in range(count)], paths[split])
        logger.info("%s: %d counting images written to %s", split, count, paths[split])
    return paths["train"], paths["test"]
