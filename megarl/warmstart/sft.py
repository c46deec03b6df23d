"""The tiny recipe's warm start (``actor_rollout_ref.model.init=tiny_sft``): a short supervised
fine-tune of :mod:`megarl.models.tiny`'s Qwen2 model on the run's prompt rows, cached on disk.

GRPO learns only from groups whose samples differ in reward, so a randomly initialised model
(reward 0 everywhere) gives it nothing to learn from. :func:`ensure_tiny_sft` trains the tiny
model on ``chat template(prompt) -> ground truth + <|im_end|>`` (loss on the answer tokens only)
just long enough that sampling at T=1 is right part of the time, and saves it as an HF model
directory that the trainer then loads like any pretrained model.

Stopping. On 2-digit addition the sampled reward does not rise smoothly: it stays near 5 %,
then climbs to 80 % within about 100 steps, and when that happens varies by 150 steps or more
from one seed to the next (measured, 325 steps at lr 2e-3 decaying over the last 20 %: seeds
0, 1, 2 ended at 26 %, 10 % and 79 % sampled reward). A fixed step count therefore starts GRPO
anywhere from 5 % to 85 %. With ``stop_reward`` set, training instead stops at the first check
(every :data:`CHECK_EVERY` steps) where the model's sampled (T=1) reward on the first
:data:`NUM_PROBE_ROWS` training prompts reaches it; ``steps`` is then an upper bound. That
reward is the one GRPO's first step measures. Measured with ``stop_reward=0.5``, ``steps=800``,
lr 2e-3, batch 64: seeds 0-5 stopped after 325-650 steps with 42-58 % sampled and 58-83 %
greedy accuracy on held-out problems.

Cache. The directory holds ``megarl_tiny_sft.json`` (:data:`MARKER_NAME`) with the settings
that produced it: steps, learning rate, seed, batch size, stop reward, model sizes, a hash of
the tokenizer and a hash of the training examples. A later call with equal settings returns at
once; any difference retrains and replaces the directory. The marker is written last, into a
temporary sibling directory that is renamed into place under a file lock (``<path>.lock``), so
a second process waits for the first and never sees a half-written model.

Sampling. The reward checks and :func:`tiny_sft_accuracy` sample with
:func:`megarl.models.sampling.generate` (this package sits below the rollout engines), which returns
what megarl's HF engine returns for the same seed, bit for bit, and score with the reward registry's
scorer: the reward GRPO reports for the same model, rows and temperature.

Shape legend: ``N`` examples, ``B`` batch rows, ``S`` tokens (prompt + answer, right-padded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.data.files import read_columns, read_table
from megarl.data.images import image_messages, load_images
from megarl.models.sampling import eos_token_ids, generate
from megarl.models.tiny import VISION_ARCHS, build_tiny_model, tiny_image_processor, tiny_tokenizer
from megarl.parallel.pipeline import vision_inputs
from megarl.reward.registry import default_compute_score
from megarl.seeds import sft_probe_seed

logger = logging.getLogger(__name__)

MARKER_NAME = "megarl_tiny_sft.json"
"""The file, inside a finished warm-start directory, that records its settings and results."""

MARKER_FORMAT = 1
"""Version of the warm-start procedure; bump it when training changes so old caches retrain."""

DEFAULT_MODEL_SIZES: Mapping[str, int] = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                                          "intermediate_size": 256}
"""Sizes of the warm-started model (keyword arguments of :func:`megarl.models.tiny.tiny_qwen2_config`)."""
DEFAULT_VL_SIZES: Mapping[str, int] = {**DEFAULT_MODEL_SIZES, "vision_hidden": 64}
"""Sizes of the warm-started tiny Qwen2.5-VL (:func:`megarl.models.tiny.tiny_qwen2_5_vl_config`): the dense
model's language sizes, a 2-block vision tower 64 wide."""
DEFAULT_MOE_SIZES: Mapping[str, int] = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                                        "head_dim": 32, "moe_intermediate_size": 64, "num_experts": 8,
                                        "num_experts_per_tok": 2}
"""Sizes of the warm-started tiny Qwen3-MoE (:func:`megarl.models.tiny.tiny_qwen3_moe_config`): 8 experts of a
quarter of the dense model's FFN, top-2, so a token's expert compute equals the dense model's."""

CHECK_EVERY = 25
"""With ``stop_reward``: steps between two measurements of the sampled reward."""
NUM_PROBE_ROWS = 256
"""With ``stop_reward``: training prompts (the first ones) the sampled reward is measured on."""
MAX_NEW_TOKENS = 16
"""Response budget when measuring rewards (the tiny recipe's ``data.max_response_length``)."""

WARMUP_FRACTION = 0.1
"""Share of the SFT steps over which the learning rate rises linearly from 0."""
DECAY_FRACTION = 0.3
"""Share of the SFT steps (at the end) over which the learning rate falls linearly to :data:`FINAL_LR_FACTOR`."""
FINAL_LR_FACTOR = 0.05
"""Learning rate of the last step, as a fraction of the peak."""

_IGNORE_INDEX = -100  # label of prompt and padding tokens: no loss there
_FINAL_LOSS_WINDOW = 25  # the reported final loss is the mean over this many last steps


# ------------------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class SFTRow:
    """One training row: what the model is asked, what it should answer, how it is scored."""

    messages: list[dict[str, str]]
    """The chat prompt (``prompt`` column)."""
    answer: str
    """The target response (``reward_model.ground_truth``)."""
    data_source: str
    """Picks the reward scorer (``data_source`` column)."""
    images: tuple = ()
    """The row's images (RGB, from the ``images`` column; a vision-language model's data), placed at the
    prompt's ``<image>`` markers."""

    def key(self) -> list:
        """What identifies the row in the cache's data hash (an image by its pixels)."""
        pixels = [hashlib.sha256(image.tobytes()).hexdigest() for image in self.images]
        return [self.messages, self.answer, self.data_source, pixels]


SFT_COLUMNS = ("data_source", "prompt", "reward_model")
"""The columns of the training files the warm start reads (and ``images`` where a file has it)."""
IMAGE_COLUMN = "images"


def read_sft_rows(files: Sequence[str | os.PathLike] | str | os.PathLike) -> list[SFTRow]:
    """Every row of the ``files`` (.parquet, .json or .jsonl; megarl's row schema), in file order."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not files:
        raise ValueError("the tiny_sft warm start needs data.train_files; got an empty list")
    rows = []
    for file in files:
        path = Path(file).expanduser()
        missing = [c for c in SFT_COLUMNS if c not in read_columns(path)]
        if missing:
            raise ValueError(f"{path}: no column(s) {missing}; the tiny_sft warm start reads {list(SFT_COLUMNS)} "
                             f"of megarl's row schema (data.train_files; build the file with "
                             f"tools/make_addition_data.py)")
        columns = list(SFT_COLUMNS) + ([IMAGE_COLUMN] if IMAGE_COLUMN in read_columns(path) else [])
        table = read_table(path).select(columns)
        for index, row in enumerate(table.to_pylist()):
            ground_truth = (row["reward_model"] or {}).get("ground_truth")
            if not row["prompt"] or ground_truth is None:
                raise ValueError(f"{file} row {index} has no prompt or no reward_model.ground_truth; the tiny_sft "
                                 f"warm start trains on prompt -> ground truth (build the file with "
                                 f"tools/make_addition_data.py)")
            messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
            images = load_images(row.get(IMAGE_COLUMN), f"{file} row {index}", base_dir=Path(file).parent)
            if images:
                messages = image_messages(messages, len(images), f"{file} row {index}")
            rows.append(SFTRow(messages, str(ground_truth), row["data_source"], tuple(images)))
    return rows


def vision_rows(rows: Sequence[SFTRow], processor: Any) -> list[dict | None] | None:
    """Each row's vision inputs (``pixel_values``, ``image_grid_thw``; None without images); None for text rows."""
    if not any(row.images for row in rows):
        return None
    return [processor.pixels(list(row.images)) if row.images else None for row in rows]


def encode_prompt_ids(rows: Sequence[SFTRow], tokenizer: Any, processor: Any = None,
                      vision: Sequence[dict | None] | None = None) -> list[list[int]]:
    """The chat-templated prompt (with the generation prompt) of each row, as token ids (with ``processor``, an
    :class:`~megarl.data.images.ImageProcessor`: each image's placeholder expanded to its merged patches, by the
    rows' ``vision`` inputs when given, else :func:`vision_rows`'s)."""
    if vision is None and processor is not None:
        vision = vision_rows(rows, processor)
    out = []
    for n, row in enumerate(rows):
        ids = list(tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        if row.images:
            ids = processor.expand(ids, vision[n]["image_grid_thw"])
        out.append(ids)
    return out


def encode_sft_examples(rows: Sequence[SFTRow], tokenizer: Any, processor: Any = None) -> tuple:
    """``(input_ids_NS, attention_mask_NS, labels_NS)``: templated prompt, answer + EOS, right-padded; rows with
    images add each row's vision inputs (:func:`vision_rows`) as a fourth item.

    Labels are the input ids on the answer and EOS tokens and ``-100`` elsewhere (the model
    shifts them by one).
    """
    vision = vision_rows(rows, processor) if processor is not None else None
    prompts = encode_prompt_ids(rows, tokenizer, processor, vision)
    targets = [tokenizer.encode(row.answer + tokenizer.eos_token, add_special_tokens=False) for row in rows]
    width = max(len(p) + len(t) for p, t in zip(prompts, targets))
    input_ids_NS = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask_NS = torch.zeros((len(rows), width), dtype=torch.long)
    labels_NS = torch.full((len(rows), width), _IGNORE_INDEX, dtype=torch.long)
    for n, (prompt, target) in enumerate(zip(prompts, targets)):
        length = len(prompt) + len(target)
        input_ids_NS[n, :length] = torch.tensor(prompt + target)
        attention_mask_NS[n, :length] = 1
        labels_NS[n, len(prompt):length] = torch.tensor(target)
    return (input_ids_NS, attention_mask_NS, labels_NS) + (() if vision is None else (vision,))


# -------------------------------------------------------------------------------------- rewards


def sample_responses(model: torch.nn.Module, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], *,
                     temperature: float, seed: int, max_new_tokens: int = MAX_NEW_TOKENS,
                     vision: Sequence[dict | None] | None = None) -> list[list[int]]:
    """One response (token ids) per prompt, sampled from ``model`` as it is, seeded by ``seed``.

    The tokens megarl's HF engine returns for ``SamplingParams(max_new_tokens, temperature, seed)``
    (see :mod:`megarl.models.sampling`); ``temperature=0`` is greedy. ``vision``: each prompt's vision inputs
    (:func:`vision_rows`), a vision-language model's.
    """
    prompts = None
    if vision is not None:
        from megarl.models import family_for
        from megarl.models.vision import model_config

        config = model_config(model.config)
        prompts = family_for(config).vision.prompts(config, prompt_ids, vision)
    return generate(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                    stop_token_ids=eos_token_ids(model, tokenizer), vision=prompts)


def mean_reward(model: torch.nn.Module, tokenizer: Any, rows: Sequence[SFTRow], prompt_ids: Sequence[Sequence[int]],
                *, temperature: float, seed: int, max_new_tokens: int = MAX_NEW_TOKENS,
                vision: Sequence[dict | None] | None = None) -> float:
    """Mean reward of one response per row, sampled from ``model`` by :func:`sample_responses`.

    Responses are decoded without special tokens and scored by the reward registry's scorer
    for the row's ``data_source``, as the trainer's reward manager does.
    """
    responses = sample_responses(model, tokenizer, prompt_ids, temperature=temperature, seed=seed,
                                 max_new_tokens=max_new_tokens, vision=vision)
    total = sum(rule_score(row, tokenizer.decode(output_ids, skip_special_tokens=True))
                for row, output_ids in zip(rows, responses))
    return total / len(rows)


def rule_score(row: SFTRow, response: str) -> float:
    """The reward registry's score of ``response`` (decoded text) to ``row``, as the trainer's reward manager
    scores it."""
    result = default_compute_score(row.data_source, response, row.answer, {})
    return float(result["score"] if isinstance(result, dict) else result)


def reward_probe(model: torch.nn.Module, tokenizer: Any, rows: Sequence[SFTRow], *, seed: int,
                 processor: Any = None) -> Callable[[int], float]:
    """``probe(step)``: the sampled (T=1) mean reward of ``model``, as it is now, on ``rows``.

    Sampling is seeded by ``seed`` and ``step``, so a run reproduces its measurements.
    """
    vision = vision_rows(rows, processor) if processor is not None else None
    prompt_ids = encode_prompt_ids(rows, tokenizer, processor, vision)

    def probe(step: int) -> float:
        model.eval()
        try:
            return mean_reward(model, tokenizer, rows, prompt_ids, temperature=1.0, seed=sft_probe_seed(seed, step),
                               vision=vision)
        finally:
            model.train()

    return probe


# ------------------------------------------------------------------------------------- training


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(num_threads)`` (unchanged when None)."""
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _batch_order(num_examples: int, steps: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Indices of each step's batch: consecutive slices of reshuffled epochs."""
    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        while order.numel() < batch_size:
            order = torch.cat([order, torch.randperm(num_examples, generator=generator)])
        yield order[:batch_size]
        order = order[batch_size:]


def lr_factor(step: int, steps: int) -> float:
    """The learning rate of 0-based ``step`` of ``steps``, as a fraction of the peak: linear warm-up
    over :data:`WARMUP_FRACTION` of the steps, constant, then linear decay over the last
    :data:`DECAY_FRACTION` to :data:`FINAL_LR_FACTOR`."""
    warmup = max(1, round(WARMUP_FRACTION * steps))
    decay_start = min(max(warmup, round((1.0 - DECAY_FRACTION) * steps)), steps - 1)
    if step < warmup:
        return (step + 1) / warmup
    if step < decay_start:
        return 1.0
    return 1.0 - (1.0 - FINAL_LR_FACTOR) * (step - decay_start) / max(1, steps - 1 - decay_start)


@dataclasses.dataclass
class SFTResult:
    """What one SFT run did."""

    losses: list[float]
    """The loss of every step taken."""
    rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """``(steps taken, sampled reward)`` of every check."""

    @property
    def final_loss(self) -> float:
        """Mean loss of the last steps (up to 25)."""
        window = self.losses[-_FINAL_LOSS_WINDOW:]
        return sum(window) / len(window)


def train_sft(model: torch.nn.Module, examples: tuple, *, steps: int,
              lr: float, batch_size: int, seed: int, stop_reward: float | None = None,
              probe: Callable[[int], float] | None = None, progress: bool = True) -> SFTResult:
    """Fine-tune ``model`` in place for up to ``steps`` AdamW steps.

    ``examples``: :func:`encode_sft_examples`'s (with images: their vision inputs fed with each batch).
    The learning rate follows :func:`lr_factor` over ``steps``. Batches are drawn from
    reshuffled epochs of ``examples`` with a generator seeded by ``seed``; the loss is the
    mean over the batch's answer tokens; gradients are clipped to norm 1. With ``stop_reward``,
    ``probe(steps taken)`` is called every :data:`CHECK_EVERY` steps and training stops once
    it returns at least ``stop_reward``.
    """
    from tqdm.auto import tqdm

    if stop_reward is not None and probe is None:
        raise ValueError("train_sft: stop_reward needs a probe to measure the reward with")
    input_ids_NS, attention_mask_NS, labels_NS, *vision = examples
    vision = vision[0] if vision else None
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    model.train()
    result = SFTResult(losses=[])
    bar = tqdm(total=steps, desc="tiny SFT", unit="step", disable=not progress)
    for rows_B in _batch_order(input_ids_NS.shape[0], steps, batch_size, generator):
        width = int(attention_mask_NS[rows_B].sum(dim=1).max())  # drop the all-padding tail
        inputs = {}
        if vision is not None:  # the batch's images, rows in order, and where their placeholders are
            inputs = vision_inputs([vision[i] for i in rows_B.tolist()]) or {}
            inputs["mm_token_type_ids"] = (input_ids_NS[rows_B, :width] == model.config.image_token_id).int()
        loss = model(input_ids=input_ids_NS[rows_B, :width], attention_mask=attention_mask_NS[rows_B, :width],
                     labels=labels_NS[rows_B, :width], **inputs).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        result.losses.append(loss.item())
        bar.update(1)
        taken = len(result.losses)
        if stop_reward is not None and taken % CHECK_EVERY == 0:
            result.rewards.append((taken, probe(taken)))
            bar.set_postfix(loss=f"{result.final_loss:.4f}", reward=f"{result.rewards[-1][1]:.3f}")
            if result.rewards[-1][1] >= stop_reward:
                break
        elif taken % CHECK_EVERY == 0:
            bar.set_postfix(loss=f"{result.final_loss:.4f}")
    bar.close()
    model.eval()
    return result


# ---------------------------------------------------------------------------------------- cache


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def tiny_sft_settings(*, steps: int, lr: float, seed: int, batch_size: int, stop_reward: float | None,
                      model_sizes: Mapping[str, int], tokenizer: Any, rows: Sequence[SFTRow]) -> dict[str, Any]:
    """What a cached warm start must have been trained with to be reused (the marker's ``settings``)."""
    return {
        "format": MARKER_FORMAT, "steps": int(steps), "lr": float(lr), "seed": int(seed),
        "batch_size": int(batch_size), "stop_reward": None if stop_reward is None else float(stop_reward),
        "model_sizes": dict(sorted(model_sizes.items())),
        "tokenizer_sha256": hashlib.sha256((tokenizer.backend_tokenizer.to_str() + str(tokenizer.chat_template))
                                           .encode()).hexdigest(),
        "data_sha256": _sha256_json([row.key() for row in rows]),
        "num_examples": len(rows),
    }


def read_marker(path: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of the warm start at ``path``, or None when there is no finished one."""
    marker = Path(path).expanduser() / MARKER_NAME
    if not marker.is_file():
        return None
    return json.loads(marker.read_text())


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing) for the block."""
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_replaceable(path: Path) -> None:
    """Refuse to overwrite a directory that is not a tiny_sft warm start (e.g. a real model)."""
    if not path.exists():
        return
    if not path.is_dir():
        raise ValueError(f"actor_rollout_ref.model.path={path} is a file; with model.init=tiny_sft it must be a "
                         f"directory where the warm-started model is cached; point it elsewhere")
    if read_marker(path) is None and any(path.iterdir()):
        raise ValueError(f"actor_rollout_ref.model.path={path} holds files but no {MARKER_NAME}, so it is not a "
                         f"tiny_sft warm start and will not be overwritten; point model.path at a new directory "
                         f"or delete this one")


def _move_into_place(built: Path, path: Path) -> None:
    """Rename the finished ``built`` directory to ``path``, replacing an outdated one."""
    if path.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale-", dir=path.parent))
        os.replace(path, stale / path.name)
        os.replace(built, path)
        shutil.rmtree(stale)
    else:
        os.replace(built, path)


def ensure_tiny_sft(path: str | os.PathLike, train_files: Sequence[str | os.PathLike] | str | os.PathLike, *,
                    steps: int, lr: float, seed: int = 0, batch_size: int = 64, stop_reward: float | None = None,
                    model_sizes: Mapping[str, int] | None = None, num_threads: int | None = 1,
                    progress: bool = True, arch: str = "qwen2") -> Path:
    """The warm-started tiny model directory at ``path``, trained now unless cached with these settings.

    Args:
        path: the HF model directory to create (``actor_rollout_ref.model.path``).
        train_files: parquet files of megarl rows; the model learns prompt -> ground truth.
        steps, lr, batch_size: the SFT run (``model.sft_steps``, ``model.sft_lr``, ``model.sft_batch_size``).
        seed: seeds the model's initialisation, the batch order and the reward checks; equal
            settings and thread counts give equal weights (another thread count changes the
            floating-point sums, and with them the run: with ``stop_reward`` it stops elsewhere).
        stop_reward: stop once the sampled (T=1) reward on the first training prompts reaches
            it (``model.sft_stop_reward``; see the module docstring); ``steps`` is then a bound.
        model_sizes: the tiny config function's sizes; None: :data:`DEFAULT_MODEL_SIZES` (``qwen2``) or
            :data:`DEFAULT_MOE_SIZES` (``qwen3_moe``).
        num_threads: torch threads while training; None: unchanged. Measured on 2 cores, batch 64:
            idle, 0.10 s per step with one thread and 0.063 s with two; with the other core busy,
            0.10-0.16 s with one and 1.2-1.9 s with two (they wait on each other), hence 1.
        progress: show a tqdm progress bar.
        arch: the tiny model's architecture (``model.tiny_arch``: :data:`megarl.models.tiny.TINY_ARCHS`).

    Returns ``path`` (expanded). Raises ``ValueError`` when ``path`` exists but is not a warm
    start made by this function (nothing is overwritten then).
    """
    if steps < 1 or lr <= 0 or batch_size < 1:
        raise ValueError(f"the tiny_sft warm start needs model.sft_steps >= 1, model.sft_lr > 0 and "
                         f"model.sft_batch_size >= 1; got {steps}, {lr} and {batch_size}")
    if stop_reward is not None and not 0.0 < stop_reward <= 1.0:
        raise ValueError(f"model.sft_stop_reward must be in (0, 1] (or None to run all sft_steps), got {stop_reward}")
    path = Path(path).expanduser().absolute()
    if model_sizes is None:
        model_sizes = {"qwen3_moe": DEFAULT_MOE_SIZES, "qwen2_5_vl": DEFAULT_VL_SIZES}.get(arch, DEFAULT_MODEL_SIZES)
    sizes = {**model_sizes, **({"arch": arch} if arch != "qwen2" else {})}
    tokenizer = tiny_tokenizer(arch)
    rows = read_sft_rows(train_files)
    if any(row.images for row in rows) != (arch in VISION_ARCHS):
        raise ValueError(f"model.tiny_arch={arch}: the training data {'has' if arch not in VISION_ARCHS else 'has no'} "
                         f"images; a vision-language tiny model ({', '.join(VISION_ARCHS)}) trains on image data "
                         f"(data/squares), a text one on text")
    settings = tiny_sft_settings(steps=steps, lr=lr, seed=seed, batch_size=batch_size, stop_reward=stop_reward,
                                 model_sizes=sizes, tokenizer=tokenizer, rows=rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.with_name(path.name + ".lock")):
        marker = read_marker(path)
        if marker is not None and marker.get("settings") == settings:
            logger.info("tiny_sft: reusing the warm start at %s (final SFT loss %.4f)", path, marker["final_loss"])
            return path
        _check_replaceable(path)
        if marker is not None:
            logger.info("tiny_sft: the warm start at %s was made with other settings; retraining", path)
        build_in_place(path, lambda built: _build(built, tokenizer, rows, settings, sizes, num_threads=num_threads,
                                                  progress=progress))
    return path


def build_in_place(path: Path, build: Callable[[Path], None]) -> None:
    """``build(directory)`` into a temporary sibling of ``path``, then renamed to ``path`` (replacing an outdated
    one); nothing is left behind when it fails. Call it holding ``path``'s lock."""
    built = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        build(built)
        _move_into_place(built, path)
    except BaseException:
        shutil.rmtree(built, ignore_errors=True)
        raise


def _build(directory: Path, tokenizer: Any, rows: Sequence[SFTRow], settings: Mapping[str, Any],
           sizes: Mapping[str, int], *, num_threads: int | None, progress: bool) -> None:
    """Train the warm start and write model, tokenizer and (last) the marker into ``directory``."""
    start = time.perf_counter()
    stop_reward = settings["stop_reward"]
    with _torch_threads(num_threads):
        model = build_tiny_model(tokenizer, seed=settings["seed"], **sizes)
        processor = image_processor = None
        if sizes.get("arch") in VISION_ARCHS:
            from megarl.data.images import ImageProcessor

            image_processor = tiny_image_processor(patch_size=model.config.vision_config.patch_size)
            processor = ImageProcessor(image_processor, tokenizer, image_token_id=model.config.image_token_id)
        examples = encode_sft_examples(rows, tokenizer, processor)
        probe = None
        if stop_reward is not None:
            probe = reward_probe(model, tokenizer, rows[:NUM_PROBE_ROWS], seed=settings["seed"], processor=processor)
        result = train_sft(model, examples, steps=settings["steps"], lr=settings["lr"],
                           batch_size=settings["batch_size"], seed=settings["seed"], stop_reward=stop_reward,
                           probe=probe, progress=progress)
    seconds = time.perf_counter() - start
    if not math.isfinite(result.final_loss):
        raise FloatingPointError(f"the tiny_sft warm start diverged (final loss {result.final_loss}); lower "
                                 f"actor_rollout_ref.model.sft_lr={settings['lr']}")
    reward = result.rewards[-1][1] if result.rewards else None
    logger.info("tiny_sft: %d SFT steps in %.1f s, loss %.4f -> %.4f (mean of the last %d steps)%s",
                len(result.losses), seconds, result.losses[0], result.final_loss,
                min(len(result.losses), _FINAL_LOSS_WINDOW),
                "" if reward is None else f", sampled reward {reward:.3f} on {min(len(rows), NUM_PROBE_ROWS)} prompts")
    if reward is not None and reward < stop_reward:
        logger.warning("tiny_sft: the sampled reward is %.3f after all %d steps, below model.sft_stop_reward=%s; "
                       "GRPO starts lower than asked (raise model.sft_steps to train longer)",
                       reward, settings["steps"], stop_reward)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    if image_processor is not None:
        image_processor.save_pretrained(directory)
    marker = {"settings": dict(settings), "steps_taken": len(result.losses), "first_loss": result.losses[0],
              "final_loss": result.final_loss, "rewards": result.rewards, "seconds": round(seconds, 2)}
    (directory / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


# ------------------------------------------------------------------------------------ accuracy


def tiny_sft_accuracy(path: str | os.PathLike, test_file: str | os.PathLike, *, num: int = 200,
                      temperature: float = 0.0, seed: int = 0, max_new_tokens: int = MAX_NEW_TOKENS) -> float:
    """Mean reward of the model at ``path`` on the first ``num`` rows of ``test_file``.

    One response per row at ``temperature`` (0: greedy) seeded by ``seed``, sampled and scored
    as in :func:`mean_reward` (fp32 on CPU: what megarl's HF engine would return).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    rows = read_sft_rows([test_file])[:num]
    if not rows:
        raise ValueError(f"{test_file} has no rows to measure accuracy on")
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = None
    if any(row.images for row in rows):
        from megarl.data.images import ImageProcessor
        from megarl.models.hf_config import load_hf_config

        processor = ImageProcessor.from_pretrained(path, tokenizer, load_hf_config(path))
    auto = AutoModelForCausalLM if processor is None else AutoModelForImageTextToText
    model = auto.from_pretrained(path, dtype=torch.float32).eval()
    vision = vision_rows(rows, processor) if processor is not None else None
    return mean_reward(model, tokenizer, rows, encode_prompt_ids(rows, tokenizer, processor, vision),
                       temperature=temperature, seed=seed, max_new_tokens=max_new_tokens, vision=vision)
