"""The tiny reward-model recipe's reward model (``reward_model.model.init=tiny_rm``): a sequence classifier trained
on CPU to predict the rule reward of the policy's own samples, cached on disk.

A reward model scores a whole response with one number read at its last token (megarl's ``RewardModelRole``;
transformers' ``*ForSequenceClassification`` reads the last non-padding token, the same one). To make one for
the tiny recipe's task without a hub, :func:`ensure_tiny_reward_model` starts from a causal LM of the policy's
tokenizer (``body``: its body, a fresh one-label score head: transformers' ``Qwen2ForSequenceClassification``),
samples ``samples_per_prompt`` responses (T=1) of the policy (``base``) to each of the first ``num_prompts``
training prompts, labels each by the rule reward of its row (the reward registry's scorer, as the trainer's reward
manager scores), adds the ground-truth answer and near misses of it (numbers off by 1 to 10), and trains the
classifier on them with a logistic loss. Held-out
prompts (the next ones) measure it the same way: how often its score's sign is the label, and its ranking AUC.
The model is what a learned reward model is: right most of the time on the policy's samples, wrong on some, and
open to being gamed as the policy moves away from them.

Cache. ``megarl_tiny_rm.json`` (:data:`MARKER_NAME`) records the settings (steps, lr, seed, sample counts, the
base's own marker, the data's hash) and the held-out figures; equal settings reuse the directory, any other
retrains it. Written as the SFT warm start is (:mod:`megarl.warmstart.sft`): into a temporary sibling, renamed
into place under a file lock.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.warmstart.sft import (
    _batch_order,
    _file_lock,
    _sha256_json,
    _torch_threads,
    build_in_place,
    encode_prompt_ids,
    lr_factor,
    read_marker,
    read_sft_rows,
    rule_score,
    sample_responses,
)

logger = logging.getLogger(__name__)

MARKER_NAME = "megarl_tiny_rm.json"
"""The file, inside a finished reward-model directory, that records its settings and held-out figures."""
MARKER_FORMAT = 1
"""Version of the procedure; bump it when training changes so old caches retrain."""
NUM_HELD_OUT = 128
"""Prompts after the training ones whose samples measure the model."""
KEY = "reward_model.model.path"


def tiny_rm_settings(*, base: Path, body: Path | None, steps: int, lr: float, seed: int, batch_size: int,
                     num_prompts: int, samples_per_prompt: int, near_misses: int, rows: Sequence) -> dict[str, Any]:
    """What a cached reward model must have been trained with to be reused (the marker's ``settings``; the base's
    and the body's own markers, so a retrained one retrains this)."""
    settings = {"format": MARKER_FORMAT, "steps": int(steps), "lr": float(lr), "seed": int(seed),
                "batch_size": int(batch_size), "num_prompts": int(num_prompts),
                "samples_per_prompt": int(samples_per_prompt), "near_misses": int(near_misses),
                "base": read_marker(base) or str(base), "data_sha256": _sha256_json([row.key() for row in rows])}
    if body is not None:
        settings.update(body_path=str(body), body=read_marker(body) or str(body))
    return settings


def ensure_tiny_reward_model(path: str | os.PathLike, train_files: Sequence[str | os.PathLike], *,
                             base: str | os.PathLike, steps: int, lr: float, seed: int = 0, batch_size: int = 64,
                             num_prompts: int = 1536, samples_per_prompt: int = 2, near_misses: int = 2,
                             num_threads: int | None = 1,
                             body: str | os.PathLike | None = None) -> Path:
    """The tiny reward model at ``path`` (an HF ``Qwen2ForSequenceClassification`` directory with the base's
    tokenizer), trained now unless cached with these settings (see the module docstring).

    Args:
        path: the directory to create (``reward_model.model.path``).
        train_files: the run's training rows (``data.train_files``): prompts, ground truths, data sources.
        base: the policy whose samples it learns to score (``actor_rollout_ref.model.path``, a causal LM of a
            family megarl serves, with its tokenizer).
        body: the causal LM whose weights the classifier starts from (``reward_model.model.body_path``); None:
            ``base``. Measured on the tiny addition task (2 cores): from the policy's warm start (stopped at a
            sampled reward of 0.3) the classifier stays near chance (held-out AUC 0.51-0.60 over lr 3e-4 to 3e-3);
            from the fully trained warm start (the distillation recipe's teacher) at lr 3e-4, 1500 steps: loss
            0.706 -> 0.234, held-out accuracy 0.90, AUC 0.93 (0.89 on sampled responses alone), 154 s.
        steps, lr, batch_size: the classifier's training (``reward_model.model.rm_steps``, ``rm_lr``).
        seed: seeds the sampling, the head's initialisation and the batch order.
        num_prompts, samples_per_prompt, near_misses: the training prompts (the first rows), responses sampled per
            prompt and near misses of its ground truth per prompt (:func:`near_misses`).
        num_threads: torch threads while building; None: unchanged.

    Raises ``ValueError`` when ``path`` holds something that is not such a model (nothing is overwritten), or when
    there are too few rows for the training and held-out prompts.
    """
    if steps < 1 or lr <= 0 or batch_size < 1 or num_prompts < 1 or samples_per_prompt < 1:
        raise ValueError(f"the tiny_rm reward model needs reward_model.model.rm_steps >= 1 and rm_lr > 0; got "
                         f"{steps} and {lr}")
    path, base = Path(path).expanduser().absolute(), Path(base).expanduser().absolute()
    body = None if body is None else Path(body).expanduser().absolute()
    rows = read_sft_rows(train_files)
    if len(rows) < num_prompts + NUM_HELD_OUT:
        raise ValueError(f"the tiny_rm reward model trains on {num_prompts} prompts and measures on {NUM_HELD_OUT} "
                         f"more; data.train_files has {len(rows)} rows")
    rows = rows[:num_prompts + NUM_HELD_OUT]
    settings = tiny_rm_settings(base=base, body=body, steps=steps, lr=lr, seed=seed, batch_size=batch_size,
                                num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                                near_misses=near_misses, rows=rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.with_name(path.name + ".lock")):
        marker = _read(path)
        if marker is not None and marker.get("settings") == settings:
            logger.info("tiny_rm: reusing the reward model at %s (held-out accuracy %.3f)", path, marker["accuracy"])
            return path
        _check_replaceable(path)
        with _torch_threads(num_threads):
            build_in_place(path, lambda built: _build(built, base, rows, settings))
    return path


def _read(path: Path) -> dict[str, Any] | None:
    marker = path / MARKER_NAME
    return json.loads(marker.read_text()) if marker.is_file() else None


def _check_replaceable(path: Path) -> None:
    """Refuse to overwrite what is not a tiny_rm reward model (a real checkpoint, say)."""
    if not path.exists():
        return
    if not path.is_dir() or (_read(path) is None and any(path.iterdir())):
        raise ValueError(f"{KEY}={path} is not a tiny_rm reward model (no {MARKER_NAME}) and will not be "
                         f"overwritten; point {KEY} at a new directory or delete this one")


def labelled_samples(policy: torch.nn.Module, tokenizer: Any, rows: Sequence, *, samples: int, near: int, seed: int
                     ) -> tuple[list[list[int]], list[float]]:
    """Each row's prompt followed by ``samples`` sampled responses (T=1), its ground truth and ``near`` near misses
    of it (:func:`near_misses`), as token ids, and each one's rule reward."""
    prompts = encode_prompt_ids(rows, tokenizer)
    sequences, labels = [], []
    for k in range(samples):
        responses = sample_responses(policy, tokenizer, prompts, temperature=1.0, seed=seed * 1000 + k)
        for row, prompt, response in zip(rows, prompts, responses):
            sequences.append(prompt + list(response))
            labels.append(rule_score(row, tokenizer.decode(response, skip_special_tokens=True)))
    generator = torch.Generator().manual_seed(seed)
    for row, prompt in zip(rows, prompts):
        answers = [row.answer] + near_misses(row.answer, near, generator)
        for answer in answers:
            sequences.append(prompt + tokenizer.encode(answer + tokenizer.eos_token, add_special_tokens=False))
            labels.append(rule_score(row, answer))
    return sequences, labels


def near_misses(answer: str, count: int, generator: torch.Generator) -> list[str]:
    """``count`` wrong answers close to a numeric ``answer`` (off by 1 to 10, either way); none for another."""
    try:
        value = int(answer.strip())
    except ValueError:
        return []
    deltas = torch.randint(1, 11, (count,), generator=generator) * (torch.randint(0, 2, (count,), generator=generator)
                                                                    * 2 - 1)
    return [str(value + int(d)) for d in deltas]


def _padded(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for n, sequence in enumerate(sequences):
        ids[n, :len(sequence)] = torch.tensor(sequence)
        mask[n, :len(sequence)] = 1
    return ids, mask


def scores(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """The classifier's score of each right-padded row (at its last token)."""
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), batch):
            out.append(model(input_ids=ids[start:start + batch], attention_mask=mask[start:start + batch])
                       .logits[:, 0].float())
    return torch.cat(out)


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """The chance that a positive scores above a negative (ties count half); nan without both."""
    positive, negative = score[label > 0.5], score[label <= 0.5]
    if not len(positive) or not len(negative):
        return math.nan
    above = (positive[:, None] > negative[None, :]).float() + 0.5 * (positive[:, None] == negative[None, :]).float()
    return float(above.mean())


def _build(directory: Path, base: Path, rows: Sequence, settings: Mapping[str, Any]) -> None:
    """Sample, label, train and measure the classifier; write it, its tokenizer and (last) the marker."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    start = time.perf_counter()
    seed, num_prompts = settings["seed"], settings["num_prompts"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    policy = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    train_seqs, train_labels = labelled_samples(policy, tokenizer, rows[:num_prompts], near=settings["near_misses"],
                                                samples=settings["samples_per_prompt"], seed=seed)
    held_seqs, held_labels = labelled_samples(policy, tokenizer, rows[num_prompts:], near=settings["near_misses"],
                                              samples=settings["samples_per_prompt"], seed=seed + 1)
    del policy
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(settings.get("body_path") or base, num_labels=1,
                                                               dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    ids, mask = _padded(train_seqs, tokenizer.pad_token_id)
    labels = torch.tensor(train_labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step, index in enumerate(_batch_order(len(ids), settings["steps"], settings["batch_size"], generator)):
        for group in optimizer.param_groups:
            group["lr"] = settings["lr"] * lr_factor(step, settings["steps"])
        logits = model(input_ids=ids[index], attention_mask=mask[index]).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"the tiny_rm reward model diverged; lower reward_model.model.rm_lr="
                                 f"{settings['lr']}")
    model.eval()
    held_ids, held_mask = _padded(held_seqs, tokenizer.pad_token_id)
    held = torch.tensor(held_labels)
    held_scores = scores(model, held_ids, held_mask)
    sampled = settings["samples_per_prompt"] * (len(rows) - num_prompts)  # the held-out samples (first)
    figures = {"accuracy": float(((held_scores > 0).float() == held).float().mean()),
               "auc": auc(held_scores, held), "sampled_auc": auc(held_scores[:sampled], held[:sampled]),
               "positive_share": float(torch.tensor(train_labels).mean()),
               "first_loss": losses[0], "final_loss": sum(losses[-25:]) / len(losses[-25:]),
               "examples": len(train_seqs), "seconds": round(time.perf_counter() - start, 2)}
    logger.info("tiny_rm: %d steps on %d labelled responses (%.0f %% positive) in %.1f s, loss %.3f -> %.3f; "
                "held out: accuracy %.3f, AUC %.3f (samples only %.3f)", len(losses), len(train_seqs),
                100 * figures["positive_share"], figures["seconds"], losses[0], figures["final_loss"],
                figures["accuracy"], figures["auc"], figures["sampled_auc"])
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / MARKER_NAME).write_text(json.dumps({"settings": dict(settings), **figures}, indent=2) + "\n")


def tiny_rm_figures(path: str | os.PathLike) -> dict[str, Any] | None:
    """The held-out figures of the reward model at ``path`` (None when it is not a tiny_rm one)."""
    marker = _read(Path(path).expanduser())
    return None if marker is None else {k: v for k, v in marker.items() if k != "settings"}

