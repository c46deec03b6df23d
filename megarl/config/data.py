"""Prompt data (``data.*``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import MISSING

from megarl.config.common import check_choice, check_positive, default_of
from megarl.data.dataset import TRUNCATION_MODES, PromptDataset


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Prompt data (``data.*``); the data-set keys are :class:`megarl.data.PromptDataset`'s keyword arguments."""

    train_files: list[str] = MISSING
    """Training data files: ``.parquet``, ``.json`` or ``.jsonl`` (verl's row schema: megarl.data.dataset)."""
    val_files: list[str] = dataclasses.field(default_factory=list)
    """Validation data files (as ``train_files``); empty: no validation."""
    train_batch_size: int = 1024
    """Prompts per PPO iteration (each is sampled ``rollout.n`` times)."""
    val_batch_size: int | None = None
    """Prompts per validation generate call; None: the whole validation set at once."""
    max_prompt_length: int = default_of(PromptDataset, "max_prompt_length")
    """Longest templated prompt in tokens; longer ones are filtered or truncated (``truncation``)."""
    max_response_length: int = 1024
    """Longest response in tokens (the rollout's ``R``)."""
    truncation: str = default_of(PromptDataset, "truncation")
    """What to do with an over-long prompt that is not filtered: ``error``, ``left``, ``right`` or ``middle``."""
    filter_overlong_prompts: bool = default_of(PromptDataset, "filter_overlong_prompts")
    """Drop prompts longer than ``max_prompt_length`` when the data set is built."""
    prompt_key: str = default_of(PromptDataset, "prompt_key")
    """Column holding the prompt: chat messages, or a string (one user message); slime's ``--input-key``."""
    label_key: str | None = default_of(PromptDataset, "label_key")
    """Column holding the ground truth (slime's ``--label-key``); None: verl's ``reward_model.ground_truth``."""
    data_source_key: str = default_of(PromptDataset, "data_source_key")
    """Column whose value picks each row's reward scorer (``reward_model.*``, custom reward function)."""
    data_source: str | None = default_of(PromptDataset, "data_source")
    """Data source of every row of a file without the ``data_source_key`` column (slime's JSONL has none)."""
    metadata_key: str | None = default_of(PromptDataset, "metadata_key")
    """Column that becomes ``extra_info`` (slime's ``--metadata-key``); None: verl's ``extra_info``."""
    return_raw_chat: bool = default_of(PromptDataset, "return_raw_chat")
    """Keep the raw messages in the batch; multi-turn rollouts need them."""
    return_full_prompt: bool = default_of(PromptDataset, "return_full_prompt")
    """Keep the templated prompt text in the batch (for logging)."""
    need_tools_kwargs: bool = default_of(PromptDataset, "need_tools_kwargs")
    """Every row must carry ``extra_info.tools_kwargs`` (tool-using tasks)."""
    apply_chat_template: bool = default_of(PromptDataset, "apply_chat_template")
    """Render prompts with the tokenizer's chat template; False: prompts are plain text used as they are,
    with the tokenizer's special tokens (slime without ``--apply-chat-template``; base models)."""
    apply_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments of ``tokenizer.apply_chat_template``."""
    image_key: str | None = default_of(PromptDataset, "image_key")
    """The column holding each row's images (verl's ``images``: bytes or paths, placed at the prompt's ``<image>``
    markers; a vision-language model's data). None: read every file as text."""
    max_image_pixels: int = default_of(PromptDataset, "max_image_pixels")
    """The most pixels a row's image may have: a larger one (or a decompression bomb) skips its row, counted, before
    it is decoded."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded by ``trainer.seed``)."""

    def __post_init__(self) -> None:
        check_positive("data.train_batch_size", self.train_batch_size)
        check_positive("data.val_batch_size", self.val_batch_size, allow_none=True)
        check_positive("data.max_prompt_length", self.max_prompt_length)
        check_positive("data.max_response_length", self.max_response_length)
        check_positive("data.max_image_pixels", self.max_image_pixels)
        check_choice("data.truncation", self.truncation, TRUNCATION_MODES)
        if not self.train_files:
            raise ValueError("data.train_files is empty: give at least one training data file (.parquet, .json, "
                             ".jsonl)")

    def dataset_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`megarl.data.PromptDataset` (besides the files and the tokenizer)."""
        return {
            "max_prompt_length": self.max_prompt_length, "truncation": self.truncation,
            "filter_overlong_prompts": self.filter_overlong_prompts, "prompt_key": self.prompt_key,
            "return_raw_chat": self.return_raw_chat, "return_full_prompt": self.return_full_prompt,
            "need_tools_kwargs": self.need_tools_kwargs, "label_key": self.label_key,
            "data_source_key": self.data_source_key, "data_source": self.data_source,
            "metadata_key": self.metadata_key,
            "apply_chat_template_kwargs": dict(self.apply_chat_template_kwargs),
            "apply_chat_template": self.apply_chat_template, "image_key": self.image_key,
            "max_image_pixels": self.max_image_pixels,
        }
