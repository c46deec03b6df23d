"""Generation only (``generation.*``): what ``megarl-generate`` writes (verl's ``main_generation``)."""

from __future__ import annotations

import dataclasses

from megarl.config.common import check_positive
from megarl.data.files import data_format


@dataclasses.dataclass(kw_only=True)
class GenerationConfig:
    """``megarl-generate``: responses for the prompts of ``data.train_files`` (verl's ``data.path``), sampled with
    ``actor_rollout_ref.rollout``'s settings from ``actor_rollout_ref.model.path``."""

    output_path: str | None = None
    """Where the prompts' rows are written back with a ``responses`` column (a list of ``n_samples`` strings per
    row): ``.parquet``, ``.json`` or ``.jsonl`` (verl's ``data.output_path``). Required by ``megarl-generate``."""
    n_samples: int | None = None
    """Responses per prompt (verl's ``data.n_samples``); None: ``actor_rollout_ref.rollout.n``."""
    batch_size: int = 128
    """Prompts sent to the engines per round (verl's ``data.batch_size``)."""
    overwrite: bool = False
    """Write over an existing ``output_path`` (refused otherwise, before anything runs). An input file of
    ``data.train_files`` is never written over."""

    def __post_init__(self) -> None:
        check_positive("generation.n_samples", self.n_samples, allow_none=True)
        check_positive("generation.batch_size", self.batch_size)
        if self.output_path is not None:
            try:
                data_format(self.output_path)
            except ValueError as error:
                raise ValueError(f"generation.output_path: {error}") from error
