"""Data that flows through a training step: the :class:`Batch` container, prompt
datasets from parquet, JSON or JSONL (:class:`PromptDataset`, :func:`collate`) and chat-template helpers."""

from megarl.data.batch import Batch
from megarl.data.chat import check_messages, encode_prompt, render_prompt
from megarl.data.dataset import TRUNCATION_MODES, OverlongPrompt, PromptDataset, collate, truncate_ids

__all__ = [
    "Batch",
    "OverlongPrompt",
    "PromptDataset",
    "TRUNCATION_MODES",
    "check_messages",
    "collate",
    "encode_prompt",
    "render_prompt",
    "truncate_ids",
]
