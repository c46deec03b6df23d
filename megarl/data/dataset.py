"""Prompt datasets: rows of chat prompts, templated, tokenised, filtered; and collate.

Files are ``.parquet``, ``.json`` or ``.jsonl`` (:mod:`megarl.data.files`). Row schema (verl's;
written by ``tools/prepare_gsm8k.py`` and ``tools/make_addition_data.py``):

- ``data_source`` (str): picks the reward scorer;
- ``prompt`` (the column named by ``prompt_key``): a list of chat messages ``{role, content}``, or
  a plain string, which becomes one user message;
- ``ability`` (str), e.g. ``"math"``;
- ``reward_model``: ``{"style": "rule", "ground_truth": str}``;
- ``extra_info``: ``{"split", "index", ...}``, optionally ``need_tools_kwargs``,
  ``tools_kwargs`` (``{tool_name: {"create_kwargs", "execute_kwargs", "calc_reward_kwargs",
  "release_kwargs"}}``, each optional) and ``interaction_kwargs``.

Other layouts (slime's JSONL: ``{"prompt": "What is 2+3?", "label": "5"}``) are mapped onto it when
the table is read: ``label_key`` names the ground-truth column (it becomes
``reward_model = {"ground_truth", "style": "rule"}``), ``data_source_key`` the data-source column and
``data_source`` a fixed value for files without one, ``metadata_key`` the column that becomes
``extra_info``.

With ``apply_chat_template=False`` (slime's default, for base models) a prompt is a string used as it
is: no chat template, tokenised with the tokenizer's own special tokens (a BOS where it has one).

:class:`PromptDataset` returns one dict per row (see :meth:`PromptDataset.__getitem__`) and
:func:`collate` turns a list of them into a :class:`~megarl.data.batch.Batch` of left-padded
prompts plus per-row non-tensor fields.

Shape legend: ``B`` rows, ``P`` prompt tokens after padding.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.data.chat import check_messages, encode_prompts, render_prompt, row_tool_names
from megarl.data.images import MAX_IMAGE_PIXELS, BadImage, SkippedRow, image_messages, load_images

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
"""``data.truncation`` values: raise, keep the last, the first, or the first and last halves."""

PRODUCED_KEYS = ("input_ids", "raw_prompt_ids", "raw_prompt", "full_prompts", "index", "tools_kwargs",
                 "interaction_kwargs", "multi_modal_data", "multi_modal_inputs")
"""Row keys the dataset computes; a data column with one of these names is refused."""

_ENCODE_CHUNK = 1024  # prompts per batched tokenizer call while measuring lengths


@dataclasses.dataclass(frozen=True)
class OverlongPrompt:
    """A row dropped by ``filter_overlong_prompts``: where it was and how long its prompt is."""

    file: str
    """The data file."""
    row: int
    """0-based row number in that file."""
    num_tokens: int
    """Tokens of the templated prompt."""


def truncate_ids(ids: list[int], max_length: int, truncation: str, where: str) -> list[int]:
    """``ids`` cut to ``max_length`` tokens by ``truncation`` (see :data:`TRUNCATION_MODES`).

    ``left`` keeps the last ``max_length`` tokens, ``right`` the first, ``middle`` the first
    ``max_length // 2`` and the last ``max_length - max_length // 2``; ``error`` raises
    ``ValueError`` naming ``where``. Ids that fit are returned unchanged.
    """
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[len(ids) - max_length:]
    if truncation == "right":
        return ids[:max_length]
    if truncation == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head):]
    if truncation == "error":
        raise ValueError(f"{where}: the templated prompt has {len(ids)} tokens, more than "
                         f"data.max_prompt_length={max_length}; raise max_prompt_length, set "
                         f"data.filter_overlong_prompts=True to drop such rows, or set data.truncation to "
                         f"'left', 'right' or 'middle'")
    raise ValueError(f"data.truncation={truncation!r} is unknown; use one of {TRUNCATION_MODES}")


def _extra_info(extra_info: Any, where: str) -> Mapping[str, Any]:
    """A row's ``extra_info`` (``{}`` when null), or ``ValueError`` if it is not a dict."""
    if extra_info is None:
        return {}
    if not isinstance(extra_info, Mapping):
        raise ValueError(f"{where}: extra_info must be a dict (split, index, tools_kwargs, ...), got "
                         f"{type(extra_info).__name__}")
    return extra_info


def prompt_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    """A row's prompt as chat messages: a plain string becomes one user message (slime's text prompts),
    anything else is checked by :func:`~megarl.data.chat.check_messages`."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return check_messages(prompt, where)


def missing_scoring_columns(columns: Sequence[str], *, label_key: str | None = None,
                            data_source_key: str = "data_source", data_source: str | None = None) -> list[str]:
    """The columns a file lacks to pick each row's reward scorer and give its ground truth: the data-source
    column (unless ``data_source`` fills it in) and ``label_key`` (default: verl's ``reward_model``)."""
    wanted = ([] if data_source is not None else [data_source_key]) + [label_key or "reward_model"]
    return [column for column in wanted if column not in columns]


def _clean_tools_kwargs(tools_kwargs: Any, where: str) -> dict[str, dict[str, Any]]:
    """``{tool: {kind: kwargs}}`` without the nulls parquet adds for keys other rows have."""
    if tools_kwargs is None:
        return {}
    if not isinstance(tools_kwargs, Mapping):
        raise ValueError(f"{where}: extra_info.tools_kwargs must be a dict {{tool_name: {{'create_kwargs': ...}}}}, "
                         f"got {type(tools_kwargs).__name__}")
    cleaned = {}
    for tool, spec in tools_kwargs.items():
        if spec is None:
            continue
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}: extra_info.tools_kwargs[{tool!r}] must be a dict of "
                             f"create/execute/calc_reward/release kwargs, got {type(spec).__name__}")
        cleaned[tool] = {kind: dict(kwargs) for kind, kwargs in spec.items() if kwargs is not None}
    return cleaned


class PromptDataset(torch.utils.data.Dataset):
    """Chat prompts from parquet, JSON or JSONL files, templated with the tokenizer's generation prompt.

    Settings are the ``data.*`` config keys.

    On construction every prompt is checked (a list of ``{role, content}`` messages or a string, else
    ``ValueError`` naming file and row). With ``filter_overlong_prompts`` each prompt is
    templated and tokenised, and rows longer than ``max_prompt_length`` tokens are dropped;
    they are counted (:attr:`num_filtered_overlong`), listed (:attr:`filtered_overlong`) and
    reported in a warning. Without it, overlong prompts meet ``truncation`` when read.

    Args:
        data_files: one ``.parquet``, ``.json`` or ``.jsonl`` path or a list of them (``data.train_files`` / ``val_files``).
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_prompt_length: token budget of a templated prompt (``P``).
        truncation: what to do with a longer prompt that was not filtered out: ``error``,
            ``left``, ``right`` or ``middle`` (:func:`truncate_ids`).
        filter_overlong_prompts: drop rows whose templated prompt exceeds ``max_prompt_length``.
        prompt_key: the column holding the prompt: chat messages, or a string (one user message).
        return_raw_chat: also return the messages as ``raw_prompt`` (needed by multi-turn rollout).
        return_full_prompt: also return the templated text as ``full_prompts``.
        need_tools_kwargs: the default of the per-row ``extra_info.need_tools_kwargs`` flag; rows
            that need tools kwargs but have none are counted and reported.
        apply_chat_template_kwargs: extra arguments of ``apply_chat_template`` (e.g. ``tools``).
        apply_chat_template: render each prompt with the tokenizer's chat template; False: every prompt
            is a string, used as it is and tokenised with the tokenizer's special tokens (slime's raw text
            prompts, for base models; no tools then).
        tool_schemas: ``{function_name: OpenAI schema}`` of the multi-turn tools: the length filter
            renders each prompt with the schemas of the tools its row is given
            (:func:`megarl.data.chat.row_tool_names`), as the agent loop will.
        label_key: the column holding the ground truth (slime's ``--label-key``); it becomes
            ``reward_model = {"ground_truth": value, "style": "rule"}`` (an integer or float as text), in
            place of a ``reward_model`` column. None: verl's ``reward_model`` column.
        data_source_key: the column whose value picks each row's reward scorer (it becomes ``data_source``).
        data_source: the data source of every row of a file without the ``data_source_key`` column.
        metadata_key: the column that becomes ``extra_info`` (slime's ``--metadata-key``), in place of an
            ``extra_info`` column. None: verl's ``extra_info``.
        image_key: the column holding each row's images (verl's ``images``; :mod:`megarl.data.images`), whose
            ``<image>`` markers place them in the prompt; None: no images.
        processor: the vision-language model's :class:`~megarl.data.images.ImageProcessor` (None: a text model,
            which refuses files with images). A row whose image is missing or corrupt, or whose markers do not
            match its images, is skipped: counted (:attr:`num_skipped`), listed (:attr:`skipped`) and reported.
    """

    def __init__(self, data_files: str | Path | Sequence[str | Path], tokenizer: Any, *,
                 max_prompt_length: int = 1024, truncation: str = "error", filter_overlong_prompts: bool = True,
                 prompt_key: str = "prompt", return_raw_chat: bool = False, return_full_prompt: bool = False,
                 need_tools_kwargs: bool = False, apply_chat_template_kwargs: Mapping[str, Any] | None = None,
                 tool_schemas: Mapping[str, Mapping[str, Any]] | None = None, label_key: str | None = None,
                 data_source_key: str = "data_source", data_source: str | None = None,
                 metadata_key: str | None = None, apply_chat_template: bool = True, image_key: str | None = "images",
                 max_image_pixels: int = MAX_IMAGE_PIXELS, processor: Any = None) -> None:
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is unknown; use one of {TRUNCATION_MODES}")
        files = [data_files] if isinstance(data_files, (str, Path)) else list(data_files)
        if not files:
            raise ValueError("PromptDataset needs at least one data file (data.train_files / data.val_files)")
        self.data_files = [str(Path(f).expanduser()) for f in files]
        self.max_image_pixels = max_image_pixels
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.prompt_key = prompt_key
        self.label_key = label_key
        self.data_source_key = data_source_key
        self.data_source = data_source
        self.metadata_key = metadata_key
        self.return_raw_chat = return_raw_chat
        self.return_full_prompt = return_full_prompt
        self.need_tools_kwargs = need_tools_kwargs
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.tool_schemas = dict(tool_schemas or {})
        self.apply_chat_template = apply_chat_template
        self.image_key = image_key
        self.processor = processor
        if processor is not None and not apply_chat_template:
            raise ValueError("data.apply_chat_template=False with a vision-language model: images are placed by the "
                             "chat template; set data.apply_chat_template=True")
        if not apply_chat_template and (self.tool_schemas or self.apply_chat_template_kwargs):
            setting = "multi-turn tools" if self.tool_schemas else "data.apply_chat_template_kwargs"
            raise ValueError(f"data.apply_chat_template=False uses each prompt as plain text, but {setting} "
                             f"need the chat template: set data.apply_chat_template=True or drop {setting}")
        if self.tool_schemas and "tools" in self.apply_chat_template_kwargs:
            raise ValueError("data.apply_chat_template_kwargs.tools and multi-turn tools are both set; the agent "
                             "loop shows the tool config's schemas: drop apply_chat_template_kwargs.tools")
        self.pad_token_id = self._pad_token_id(tokenizer)

        self._tables = [self._read(path) for path in self.data_files]
        self.num_rows_read = sum(table.num_rows for table in self._tables)
        """Rows in all files, before filtering."""
        self.filtered_overlong: list[OverlongPrompt] = []
        """Rows dropped because their templated prompt is longer than ``max_prompt_length``."""
        self.skipped: list[SkippedRow] = []
        """Rows skipped because an image cannot be read or does not match the prompt's markers."""
        self._rows: list[tuple[int, int, int]] = []  # (file number, row in file, row over all files)
        self._select_rows()
        self.num_missing_tools_kwargs = self._count_missing_tools_kwargs()
        """Kept rows that need tools kwargs (``need_tools_kwargs``) but have none."""
        logger.info("PromptDataset: %d rows from %d file(s), %d kept", self.num_rows_read, len(self.data_files),
                    len(self._rows))

    @property
    def num_skipped(self) -> int:
        """Number of rows skipped for their images (:attr:`skipped`)."""
        return len(self.skipped)

    @property
    def num_filtered_overlong(self) -> int:
        """Number of rows dropped by ``filter_overlong_prompts``."""
        return len(self.filtered_overlong)

    # ----------------------------------------------------------------------------- loading

    @staticmethod
    def _pad_token_id(tokenizer: Any) -> int:
        if tokenizer.pad_token_id is not None:
            return int(tokenizer.pad_token_id)
        if tokenizer.eos_token_id is not None:
            logger.info("PromptDataset: the tokenizer has no pad token; padding prompts with eos id %d "
                        "(padding is masked out)", tokenizer.eos_token_id)
            return int(tokenizer.eos_token_id)
        raise ValueError("the tokenizer has neither a pad token nor an eos token to pad prompts with; set "
                         "tokenizer.pad_token")

    def _read(self, path: str) -> Any:
        if not Path(path).is_file():
            raise FileNotFoundError(f"prompt data file {path!r} does not exist; check data.train_files / "
                                    f"data.val_files (prepare GSM8K with tools/prepare_gsm8k.py)")
        from megarl.data.files import read_table

        table = self._map_columns(read_table(path), path)
        if self.prompt_key not in table.column_names:
            raise ValueError(f"{path}: no column {self.prompt_key!r} (data.prompt_key); its columns are "
                             f"{table.column_names}")
        if self.processor is None and self._has_images(table):
            raise ValueError(f"{path}: column {self.image_key!r} (data.image_key) holds images, but the model "
                             f"(actor_rollout_ref.model.path) is a text model; use a vision-language model, or set "
                             f"data.image_key=null to read the file as text")
        clashes = sorted(set(table.column_names) & set(PRODUCED_KEYS))
        if clashes:
            raise ValueError(f"{path}: columns {clashes} clash with fields the dataset computes; rename them "
                             f"(put per-row extras under extra_info)")
        return table

    def _has_images(self, table: Any) -> bool:
        """Whether ``table`` has an image column with an image in some row."""
        if self.image_key is None or self.image_key not in table.column_names:
            return False
        return any(images for images in table.column(self.image_key).to_pylist())

    def _row_images(self, table: Any, row: int, where: str, path: str) -> list:
        """Row ``row``'s images, decoded (none without an image column); :class:`BadImage` when one is unreadable."""
        if self.processor is None or self.image_key is None or self.image_key not in table.column_names:
            return []
        base_dir = Path(path).parent  # relative image paths: from the data file's directory
        return load_images(table.column(self.image_key)[row].as_py(), where, base_dir=base_dir,
                           max_pixels=self.max_image_pixels)

    def _map_columns(self, table: Any, path: str) -> Any:
        """``table`` with verl's ``data_source``, ``reward_model`` and ``extra_info`` columns made from the
        columns ``data_source_key``, ``label_key`` and ``metadata_key`` name (unchanged with the defaults)."""
        import pyarrow as pa

        columns = table.column_names
        for setting, column in (("data.label_key", self.label_key), ("data.metadata_key", self.metadata_key)):
            if column is not None and column not in columns:
                raise ValueError(f"{path}: no column {column!r} ({setting}); its columns are {columns}")
        if self.data_source_key != "data_source" and self.data_source_key in columns:
            table = _set_column(table, "data_source", table.column(self.data_source_key))
        elif self.data_source is not None and self.data_source_key not in columns:
            table = _set_column(table, "data_source", pa.array([self.data_source] * table.num_rows, pa.string()))
        if self.label_key is not None:
            truth = table.column(self.label_key).combine_chunks()
            if pa.types.is_integer(truth.type) or pa.types.is_floating(truth.type):
                truth = truth.cast(pa.string())
            style = pa.array(["rule"] * table.num_rows, pa.string())
            table = _set_column(table, "reward_model",
                                pa.StructArray.from_arrays([truth, style], names=["ground_truth", "style"]))
        if self.metadata_key is not None and self.metadata_key != "extra_info":
            table = _set_column(table, "extra_info", table.column(self.metadata_key))
        return table

    def _checked_prompt(self, prompt: Any, where: str) -> list[dict[str, Any]] | str:
        """The row's prompt as chat messages, or as text when the chat template is off."""
        if self.apply_chat_template:
            return prompt_messages(prompt, where)
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: the prompt is a {type(prompt).__name__}, but data.apply_chat_template=False "
                             f"takes plain-text prompts only; set data.apply_chat_template=True for chat messages")
        return prompt

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of prompt texts: templated ones carry their special tokens already, plain ones get the
        tokenizer's."""
        return encode_prompts(self.tokenizer, texts, add_special_tokens=not self.apply_chat_template)

    def _templated(self, messages: list[dict[str, Any]] | str, tools: list[Mapping[str, Any]] | None = None) -> str:
        if isinstance(messages, str):
            return messages
        kwargs = dict(self.apply_chat_template_kwargs)
        if tools:
            kwargs["tools"] = tools
        return render_prompt(self.tokenizer, messages, **kwargs)

    def _row_tools(self, extra_infos: list[Any] | None, row: int, where: str) -> list[Mapping[str, Any]]:
        """The schemas of the tools row ``row`` is given (none without multi-turn tools)."""
        if not self.tool_schemas:
            return []
        info = _extra_info(extra_infos[row] if extra_infos is not None else None, where)
        names = row_tool_names(list(self.tool_schemas), _clean_tools_kwargs(info.get("tools_kwargs"), where))
        return [self.tool_schemas[name] for name in names]

    def _select_rows(self) -> None:
        """Check every prompt and keep the rows that fit (all rows when not filtering)."""
        global_row = 0
        for file_number, (path, table) in enumerate(zip(self.data_files, self._tables, strict=True)):
            prompts = table.column(self.prompt_key).to_pylist()
            checked = [self._checked_prompt(m, f"{path} row {r}") for r, m in enumerate(prompts)]
            # Rows with images: each image decoded now (an unreadable one skips its row, before any training), and
            # counted at the tokens it will take.
            image_tokens: list[int | None] = [0] * len(checked)
            if self._has_images(table):
                for r in range(len(checked)):
                    where = f"{path} row {r}"
                    try:
                        images = self._row_images(table, r, where, path)
                        checked[r] = image_messages(checked[r], len(images), where)
                    except (BadImage, ValueError) as error:
                        self.skipped.append(SkippedRow(path, r, str(error)))
                        image_tokens[r] = None
                        continue
                    image_tokens[r] = sum(self.processor.image_tokens(image) - 1 for image in images)
            if self.filter_overlong_prompts:
                infos = table.column("extra_info").to_pylist() if "extra_info" in table.column_names else None
                lengths = []
                for start in range(0, len(checked), _ENCODE_CHUNK):
                    rows = range(start, min(start + _ENCODE_CHUNK, len(checked)))
                    texts = [self._templated(checked[r], self._row_tools(infos, r, f"{path} row {r}")) for r in rows]
                    lengths.extend(len(ids) + (image_tokens[r] or 0)
                                   for r, ids in zip(rows, self._encode(texts), strict=True))
            else:
                lengths = [0] * len(checked)
            for row, num_tokens in enumerate(lengths):
                if image_tokens[row] is None:
                    continue
                if num_tokens > self.max_prompt_length:
                    self.filtered_overlong.append(OverlongPrompt(path, row, num_tokens))
                else:
                    self._rows.append((file_number, row, global_row + row))
            global_row += table.num_rows
        if self.skipped:
            shown = "; ".join(skip.reason for skip in self.skipped[:10])
            more = "" if len(self.skipped) <= 10 else f"; and {len(self.skipped) - 10} more"
            logger.warning("PromptDataset: skipped %d of %d rows whose images cannot be used: %s%s",
                           self.num_skipped, self.num_rows_read, shown, more)
        if self.filtered_overlong:
            shown = ", ".join(f"{p.file} row {p.row} ({p.num_tokens} tokens)" for p in self.filtered_overlong[:10])
            more = "" if len(self.filtered_overlong) <= 10 else f", and {len(self.filtered_overlong) - 10} more"
            logger.warning("PromptDataset: dropped %d of %d rows whose templated prompt is longer than "
                           "data.max_prompt_length=%d (data.filter_overlong_prompts=True): %s%s",
                           self.num_filtered_overlong, self.num_rows_read, self.max_prompt_length, shown, more)

    def data_sources(self) -> list[str]:
        """The distinct ``data_source`` values of the files' rows (they pick the reward scorer), sorted."""
        sources: set[str] = set()
        for path, table in zip(self.data_files, self._tables, strict=True):
            if "data_source" not in table.column_names:
                raise ValueError(f"{path}: no column {self.data_source_key!r} (data.data_source_key; it picks each "
                                 f"row's reward scorer); its columns are {table.column_names}; set "
                                 f"data.data_source to give every row of such files one")
            sources.update(str(value) for value in table.column("data_source").unique().to_pylist())
        return sorted(sources)

    def _count_missing_tools_kwargs(self) -> int:
        """Count (and report) kept rows whose ``need_tools_kwargs`` is on but ``tools_kwargs`` empty."""
        missing = []
        extra_infos = [t.column("extra_info").to_pylist() if "extra_info" in t.column_names else None
                       for t in self._tables]
        for file_number, row, _ in self._rows:
            where = f"{self.data_files[file_number]} row {row}"
            infos = extra_infos[file_number]
            info = _extra_info(infos[row] if infos is not None else None, where)
            needs = info.get("need_tools_kwargs")
            needs = self.need_tools_kwargs if needs is None else bool(needs)
            if needs and not _clean_tools_kwargs(info.get("tools_kwargs"), where):
                missing.append(where)
        if missing:
            logger.warning("PromptDataset: %d rows need tools kwargs (need_tools_kwargs) but have no "
                           "extra_info.tools_kwargs; their tools get no create kwargs: %s", len(missing),
                           ", ".join(missing[:10]))
        return len(missing)

    # ----------------------------------------------------------------------------- rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, item: int) -> dict[str, Any]:
        """One row: the file's columns (except the prompt column, after the column mapping) plus computed fields.

        Computed: ``input_ids`` (1-D long tensor, templated and truncated, not padded; an image's placeholder
        expanded to one per merged patch), ``raw_prompt_ids`` (the same ids as a list, for the rollout engine; one
        placeholder per image, which the engine expands), ``index``
        (``extra_info.index``, else the row's number over all files), ``tools_kwargs`` and
        ``interaction_kwargs`` (from ``extra_info``, ``{}`` when absent), and, when enabled,
        ``raw_prompt`` (the messages; the text when the chat template is off) and ``full_prompts`` (the
        templated text). With a vision-language model's processor every row also has ``multi_modal_data``
        (``{"image": [PIL images]}``, for the engine) and ``multi_modal_inputs`` (``pixel_values``,
        ``image_grid_thw``, for the model), None for a row without images.
        """
        file_number, row, global_row = self._rows[item]
        where = f"{self.data_files[file_number]} row {row}"
        table = self._tables[file_number]
        record = table.slice(row, 1).to_pylist()[0]
        messages = self._checked_prompt(record.pop(self.prompt_key), where)
        images = self._row_images(table, row, where, self.data_files[file_number])
        if self.processor is not None and self.image_key in record:
            record.pop(self.image_key)
        if images:
            messages = image_messages(messages, len(images), where)
        text = self._templated(messages, self._row_tools([record.get("extra_info")], 0, where))
        if images:
            raw_ids = self._encode([text])[0]
            pixels = self.processor.pixels(images)
            ids = self.processor.expand(raw_ids, pixels["image_grid_thw"])
            if len(ids) > self.max_prompt_length:
                raise ValueError(f"{where}: the templated prompt and its images take {len(ids)} tokens, more than "
                                 f"data.max_prompt_length={self.max_prompt_length}, and a prompt's images cannot be "
                                 f"truncated: set data.filter_overlong_prompts=True or raise max_prompt_length")
        else:
            ids = raw_ids = truncate_ids(self._encode([text])[0], self.max_prompt_length, self.truncation, where)
        if self.processor is not None:  # every row of a vision-language dataset: its images, or None
            record["multi_modal_data"] = {"image": images} if images else None
            record["multi_modal_inputs"] = pixels if images else None
        extra_info = _extra_info(record.get("extra_info"), where)
        index = extra_info.get("index")
        record.update(
            input_ids=torch.tensor(ids, dtype=torch.long),
            raw_prompt_ids=raw_ids,
            index=global_row if index is None else int(index),
            tools_kwargs=_clean_tools_kwargs(extra_info.get("tools_kwargs"), where),
            interaction_kwargs={k: v for k, v in (extra_info.get("interaction_kwargs") or {}).items()
                                if v is not None},
        )
        if self.return_raw_chat:
            record["raw_prompt"] = messages
        if self.return_full_prompt:
            record["full_prompts"] = text
        return record

    def source_row(self, item: int) -> dict[str, Any]:
        """Row ``item`` as its file holds it (after the column mapping), prompt column included."""
        file_number, row, _ = self._rows[item]
        return self._tables[file_number].slice(row, 1).to_pylist()[0]

    def collate(self, rows: Sequence[dict[str, Any]]) -> Batch:
        """:func:`collate` with this dataset's pad id, left-padding to ``max_prompt_length``."""
        return collate(rows, pad_token_id=self.pad_token_id, pad_to=self.max_prompt_length)


def _set_column(table: Any, name: str, values: Any) -> Any:
    """``table`` with column ``name`` replaced by ``values`` (appended when absent)."""
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, values)
    return table.append_column(name, values)


def collate(rows: Sequence[dict[str, Any]], *, pad_token_id: int, pad_to: int | None = None) -> Batch:
    """Rows of :class:`PromptDataset` -> a :class:`Batch` of left-padded prompts.

    Tensors: ``input_ids`` ``[B, P]`` (``pad_token_id`` on the left), ``attention_mask``
    ``[B, P]`` (1 on real tokens) and ``position_ids`` ``[B, P]`` (``cumsum(mask) - 1``,
    clipped at 0, so each prompt starts at position 0). ``P`` is ``pad_to`` when given, else
    the longest prompt. Every other key becomes a per-row non-tensor field (object array); all
    rows must have the same keys.
    """
    if not rows:
        raise ValueError("collate needs at least one row")
    keys = list(rows[0])
    if "input_ids" not in keys:
        raise ValueError(f"collate needs rows with 'input_ids' (rows of PromptDataset); got keys {keys}")
    for i, row in enumerate(rows):
        if set(row) != set(keys):
            raise ValueError(f"collate: row {i} has keys {sorted(row)} but row 0 has {sorted(keys)}; every row "
                             f"must have the same fields")
    lengths = [int(row["input_ids"].shape[0]) for row in rows]
    width = max(lengths) if pad_to is None else pad_to
    if max(lengths) > width:
        raise ValueError(f"collate: a prompt has {max(lengths)} tokens, more than pad_to={width} "
                         f"(data.max_prompt_length)")
    input_ids_BP = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask_BP = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        if length:
            input_ids_BP[i, width - length:] = row["input_ids"]
            attention_mask_BP[i, width - length:] = 1
    position_ids_BP = (attention_mask_BP.cumsum(dim=1) - 1).clamp(min=0)
    non_tensors = {}
    for key in keys:
        if key == "input_ids":
            continue
        column = np.empty(len(rows), dtype=object)
        for i, row in enumerate(rows):
            column[i] = row[key]
        non_tensors[key] = column
    tensors = {"input_ids": input_ids_BP, "attention_mask": attention_mask_BP, "position_ids": position_ids_BP}
    return Batch(tensors=tensors, non_tensors=non_tensors)
