"""The run's inputs outside its config, checked before anything is placed or started.

A config can be valid and still name things that are not there or do not fit: a model directory without
weights, a data file without the prompt column, a tool file that does not exist, a CUDA run on a machine
without a GPU, a checkpoint saved at another parallel layout, router replay for a dense model. Each check here
reads the input itself and refuses it with the key that names it and what to do, before Ray starts, so no
worker, engine or router is left to clean up. Cross-field checks of the config alone live in
:mod:`megarl.config.checks`; a checkpoint directory's own files in :mod:`megarl.controller.run_checkpoints`.

The trainer calls, in order: :func:`check_run_inputs`, :func:`check_resume_layout`, :func:`prepare_policy`
(which for the tiny recipe also writes its data and warm start), then :func:`routing_shape` when it builds the
rollout manager.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import torch

from megarl.config.checks import data_parallel_size
from megarl.config.schema import RunConfig
from megarl.controller.tracking_backends import missing_logger_packages, unreachable_trackers
from megarl.data.dataset import missing_scoring_columns
from megarl.data.files import data_format, read_columns
from megarl.warmstart.addition_data import ADDITION_DATA_DIR, ADDITION_DATA_FILES, ensure_addition_data
from megarl.warmstart.sft import ensure_tiny_sft
from megarl.warmstart.squares_data import SQUARES_DATA_DIR, SQUARES_DATA_FILES, ensure_squares_data

TINY_DATA = {ADDITION_DATA_DIR: (ADDITION_DATA_FILES, ensure_addition_data),
             SQUARES_DATA_DIR: (SQUARES_DATA_FILES, ensure_squares_data)}
"""The tiny recipes' own data (addition; red squares, with images): written where their recipes look for it when
missing, never anywhere else."""


def _ensure_tiny_reward_model(cfg: RunConfig, source, train: list[str]) -> None:
    """``reward_model.model.init=tiny_rm``: the classifier's starting model (``body_path``: a tiny SFT warm start,
    built or reused) and the reward model trained from it on the policy's samples (built or reused)."""
    from megarl.warmstart.reward_model import ensure_tiny_reward_model

    body = None
    if source.body_path is not None:
        body = ensure_tiny_sft(Path(source.body_path).expanduser(), train, steps=source.sft_steps, lr=source.sft_lr,
                               seed=cfg.trainer.seed)
    ensure_tiny_reward_model(source.local_path, train, base=cfg.actor_rollout_ref.model.local_path, body=body,
                             steps=source.rm_steps, lr=source.rm_lr, seed=cfg.trainer.seed)


def prepare_policy(cfg: RunConfig, *, scoring: bool = True) -> None:
    """Make sure the policy's HF directory and the data exist, before anything is placed: check a pretrained
    model's directories (and the critic's, the teacher's, the reward model's and the judge's), refuse missing data
    files naming the key, and for ``model.init=tiny_sft`` (``teacher.model.init`` too) write the addition data at its
    default paths and build the cached SFT warm start; a scoring model's tokenizer must be the policy's
    (:func:`check_same_tokenizer`); FP8 engines (``rollout.quantization``) get their FP8 copy of the policy.
    ``scoring`` False (generation only): the data need no columns for the reward scorers, and no scoring model is
    built."""
    from megarl.convert.fp8 import checkpoint_quantization, ensure_engine_checkpoint

    model = cfg.actor_rollout_ref.model
    if model.init != "tiny_sft":
        _check_model_directories(cfg)
        if checkpoint_quantization(model.local_path) is not None and cfg.actor_rollout_ref.rollout.quantization is None:
            raise ValueError(f"actor_rollout_ref.model.path={model.path!r} holds block-FP8 weights (as DeepSeek-V3 "
                             f"is published): the trainer reads them dequantized, and engines started from it serve "
                             f"FP8, so the weight sync must quantize: set actor_rollout_ref.rollout.quantization=fp8")
    teacher = cfg.teacher.model if cfg.teacher.enable and scoring else None
    if teacher is not None and teacher.init != "tiny_sft":
        check_model_directory(teacher.local_path, "teacher.model.path")
    train = _check_data(cfg, scoring)
    for source in (model, teacher):
        if source is not None and source.init == "tiny_sft":
            ensure_tiny_sft(source.local_path, [str(p) for p in train], steps=source.sft_steps, lr=source.sft_lr,
                            seed=cfg.trainer.seed, stop_reward=source.sft_stop_reward, arch=source.tiny_arch)
    reward_model = cfg.reward_model.model if cfg.reward_model.enable and scoring else None
    if reward_model is not None and reward_model.init == "tiny_rm":
        _ensure_tiny_reward_model(cfg, reward_model, [str(p) for p in train])
    elif reward_model is not None:
        check_model_directory(reward_model.local_path, "reward_model.model.path")
    for other in (teacher, reward_model):
        if other is not None:
            check_same_tokenizer(model, other)
    if cfg.actor_rollout_ref.rollout.quantization == "fp8":  # the engines start from an FP8 copy of the policy
        ensure_engine_checkpoint(model.local_path, cfg.run_dir)
    if cfg.reward_model.judge.enable and scoring:  # the judge reads text: its tokenizer is its own
        check_model_directory(cfg.reward_model.judge.model.local_path, "reward_model.judge.model.path")


def check_same_tokenizer(student, other) -> None:
    """A scoring model reads the policy's token ids (distillation compares the two models' log-probs of the same
    ids; a reward model scores them): refuse one (``other``: the teacher's or the reward model's section) whose
    tokenizer maps any token to another id than the policy's (or has other special tokens), or whose vocabulary
    cannot hold the policy's ids, naming both models."""
    from transformers import AutoTokenizer

    from megarl.models.hf_config import load_hf_config

    names = f"{other.KEY}.path={other.path!r} and the policy's actor_rollout_ref.model.path={student.path!r}"
    ours = AutoTokenizer.from_pretrained(student.local_tokenizer_path, trust_remote_code=student.trust_remote_code)
    theirs = AutoTokenizer.from_pretrained(other.local_tokenizer_path, trust_remote_code=other.trust_remote_code)
    vocab, theirs_vocab = ours.get_vocab(), theirs.get_vocab()
    differ = sorted((t for t in vocab.keys() | theirs_vocab.keys() if vocab.get(t) != theirs_vocab.get(t)),
                    key=lambda t: min(vocab.get(t, 1 << 62), theirs_vocab.get(t, 1 << 62)))
    if differ:
        token = differ[0]
        raise ValueError(f"{names} have different tokenizers: {len(differ)} token(s) map to other ids (first: "
                         f"{token!r} is {vocab.get(token)} for the policy, {theirs_vocab.get(token)} for "
                         f"{other.KEY}); it reads the policy's token ids: use a model of the policy's tokenizer")
    specials = {k: (getattr(ours, k), getattr(theirs, k)) for k in ("eos_token_id", "pad_token_id", "bos_token_id")}
    odd = {k: v for k, v in specials.items() if v[0] != v[1]}
    if odd:
        raise ValueError(f"{names} have different special tokens: {odd} (policy, {other.KEY})")
    size = load_hf_config(other.local_path, trust_remote_code=other.trust_remote_code).vocab_size
    if size < len(ours):
        raise ValueError(f"{names}: {other.KEY}'s vocabulary ({size}) cannot read the policy's {len(ours)} token "
                         f"ids")


def _check_model_directories(cfg: RunConfig) -> None:
    model = cfg.actor_rollout_ref.model
    if not Path(model.local_path).is_dir():
        raise ValueError(f"actor_rollout_ref.model.path={model.path!r} is not a directory; give an HF model "
                         f"directory (convert hub checkpoints with megarl-convert) or use model.init=tiny_sft")
    if model.tokenizer_path is None:
        check_model_directory(model.local_path, "actor_rollout_ref.model.path")
    else:
        check_model_directory(model.local_path, "actor_rollout_ref.model.path", parts=("config", "weights"))
        check_model_directory(model.local_tokenizer_path, "actor_rollout_ref.model.tokenizer_path",
                              parts=("tokenizer",))
    if cfg.critic.enable and cfg.critic.model_path is not None:
        check_model_directory(str(Path(cfg.critic.model_path).expanduser()), "critic.model_path",
                              parts=("config", "weights"))


def _check_data(cfg: RunConfig, scoring: bool = True) -> list[Path]:
    """The training files; a missing data file is an error naming its key, except the tiny recipe's own
    default files, which are written (never anywhere else: a typo must not fill with addition problems)."""
    data = cfg.data
    train = [Path(f).expanduser() for f in data.train_files]
    val = [Path(f).expanduser() for f in data.val_files]
    missing = [(key, p) for key, files in (("data.train_files", train), ("data.val_files", val))
               for p in files if not p.is_file()]
    tiny = cfg.actor_rollout_ref.model.init == "tiny_sft"
    written = None
    for directory, (names, ensure) in TINY_DATA.items():
        defaults = {(Path(directory) / name).resolve() for name in names}
        if missing and tiny and all(p.resolve() in defaults for _, p in missing):
            written = ensure(directory)
    if missing and written is None:
        key, path = missing[0]
        where = " or ".join(f"{d}/{{{','.join(names)}}}" for d, (names, _) in TINY_DATA.items())
        raise ValueError(f"{key}: {path} does not exist ({len(missing)} missing data file(s)); give existing data "
                         f"files: .parquet, .json or .jsonl (tools/ converts GSM8K; the tiny recipes write their own "
                         f"only at {where})")
    for key, files in (("data.train_files", train), ("data.val_files", val)):
        for path in files:
            _check_data_columns(cfg, key, path, scoring)
    return train


def _check_data_columns(cfg: RunConfig, key: str, path: Path, scoring: bool) -> None:
    """Refuse a data file of another suffix, one that cannot be read, or one without the columns the data
    settings name (the prompt, the data source, the ground truth, the metadata), naming ``key`` and the file."""
    data = cfg.data
    try:
        file_format = data_format(path)
    except ValueError as error:
        raise ValueError(f"{key}: {error}") from error
    try:
        columns = read_columns(path)
    except (OSError, ValueError, pa.ArrowException) as error:
        raise ValueError(f"{key}: {path} is not a readable {file_format} file ({error})") from error
    if data.prompt_key not in columns:
        raise ValueError(f"{key}: {path} has no column {data.prompt_key!r} (data.prompt_key) holding the chat "
                         f"messages; its columns are {columns}")
    missing_columns = missing_scoring_columns(columns, label_key=data.label_key,
                                              data_source_key=data.data_source_key, data_source=data.data_source)
    if missing_columns and scoring:
        raise ValueError(f"{key}: {path} has no column(s) {missing_columns}, which pick each row's reward scorer "
                         f"and hold its ground truth; its columns are {columns} (name other columns with "
                         f"data.data_source_key / data.label_key, or give every row one data source with "
                         f"data.data_source)")
    if data.metadata_key is not None and data.metadata_key not in columns:
        raise ValueError(f"{key}: {path} has no column {data.metadata_key!r} (data.metadata_key); its columns "
                         f"are {columns}")


MODEL_FILES = {
    "config": ("config.json",),
    "weights": ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json"),
    "tokenizer": ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json"),
}
"""What an HF model directory must hold, by part: any one of the patterns."""


def check_model_directory(path: str, key: str, *, parts=("config", "weights", "tokenizer")) -> None:
    """Refuse an HF directory that lacks a config, weights or a tokenizer, naming ``key`` and what is missing
    (transformers' own errors for an empty directory name neither the setting nor the file)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{key}={path!r} is not a directory")
    missing = [part for part in parts if not any(any(directory.glob(p)) for p in MODEL_FILES[part])]
    if missing:
        wanted = "; ".join(f"{part}: one of {', '.join(MODEL_FILES[part])}" for part in missing)
        raise ValueError(f"{key}={path!r} has no {' / '.join(missing)} ({wanted}); point {key} at an HF model "
                         f"directory (megarl-convert mcore-to-hf writes one)")


def check_run_inputs(cfg: RunConfig) -> None:
    """What the config names outside itself, checked before anything is placed: the machine has the
    ``trainer.device`` it asks for (a local cluster only; with ``RAY_ADDRESS`` the cluster decides), and
    the multi-turn tool and interaction files exist, the packages of the chosen ``trainer.logger`` are installed.
    Each error names the key."""
    missing = missing_logger_packages(cfg.trainer.logger) or unreachable_trackers(cfg.trainer.logger)
    if missing:
        raise ValueError(missing)
    if cfg.trainer.device == "cuda" and not os.environ.get("RAY_ADDRESS") and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but this machine has no usable CUDA GPU and RAY_ADDRESS names no "
                         "cluster: set trainer.device=cpu (with trainer.n_cpu_ranks), or run on GPU machines")
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable:
        for key, path in (("tool_config_path", multi_turn.tool_config_path),
                          ("interaction_config_path", multi_turn.interaction_config_path)):
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"actor_rollout_ref.rollout.multi_turn.{key}={path!r} does not exist")


def check_resume_layout(cfg: RunConfig, checkpoint: Path | None) -> None:
    """Refuse, before Ray, a checkpoint whose actor (or critic) was saved at another layout than the config's:
    its optimizer and RNG states load only at the saved one. The error names both layouts and the keys."""
    from megarl.workers.model_checkpoint import layout_mismatch, read_model_metadata

    if checkpoint is None:
        return
    roles = [("actor", "actor_rollout_ref.actor.parallel", cfg.actor_rollout_ref.actor.parallel)]
    if cfg.critic.enable:
        roles.append(("critic", "critic.parallel", cfg.critic.parallel))
    for role, key, parallel in roles:
        if not (checkpoint / role).is_dir():
            raise ValueError(f"checkpoint {checkpoint} has no {role}/ directory, and this run trains a {role}; resume "
                             f"from a checkpoint of a run like this one, or start fresh (trainer.resume_mode=disable)")
        dims = parallel.for_world(data_parallel_size(cfg, parallel) * parallel.model_parallel_size)
        meta = read_model_metadata(checkpoint / role)
        if role == "actor":
            _check_resume_lora(cfg, checkpoint / role, meta.get("lora"))
        mismatch = layout_mismatch(meta, dims)
        if mismatch is not None:
            raise ValueError(f"checkpoint {checkpoint / role} was {mismatch}: its optimizer and RNG states load only "
                             f"at the saved layout; set {key}.* (tp, pp, vpp, cp, ep, etp) and the world size "
                             f"(trainer.n_gpus_per_node, trainer.nnodes or trainer.n_cpu_ranks) to match it, or "
                             f"start fresh (trainer.resume_mode=disable, or another trainer.experiment_name)")


def _check_resume_lora(cfg: RunConfig, directory: Path, saved: dict | None) -> None:
    """Refuse, before Ray, resuming adapters of another rank, scale or targets than the config's (or adapters into a
    run without them, or the reverse): their tensors and optimizer states load only as saved."""
    spec = cfg.actor_rollout_ref.model.lora_spec
    wanted = None if spec is None else {"rank": spec.rank, "alpha": float(spec.alpha),
                                        "targets": sorted(spec.targets)}
    have = None if saved is None else {"rank": saved["rank"], "alpha": float(saved["alpha"]),
                                       "targets": sorted(saved["targets"])}
    if wanted == have:
        return
    key = "actor_rollout_ref.model"
    if have is None or wanted is None:
        what = "no LoRA adapters" if have is None else f"LoRA adapters ({have})"
        raise ValueError(f"checkpoint {directory} holds {what}, and this run {'has' if wanted else 'has none'}"
                         f"{f' ({wanted})' if wanted else ''}: set {key}.lora_rank to match it, or start fresh "
                         f"(trainer.resume_mode=disable, or another trainer.experiment_name)")
    differ = [f"{name} {have[name]} (this run: {wanted[name]})" for name in ("rank", "alpha", "targets")
              if have[name] != wanted[name]]
    raise ValueError(f"checkpoint {directory} holds LoRA adapters of {', '.join(differ)}: they and their optimizer "
                     f"states load only as saved; set {key}.lora_rank, lora_alpha and target_modules to match, or "
                     f"start fresh (trainer.resume_mode=disable, or another trainer.experiment_name)")


def check_policy_support(cfg: RunConfig) -> None:
    """Refuse, naming the key, before anything is placed, what the policy's family cannot do yet: LoRA on a mixture
    of experts; with a vision-language model, LoRA, context parallelism, and a teacher or a reward model (they
    would read the image placeholders without the images)."""
    model = cfg.actor_rollout_ref.model
    from megarl.models import family_for
    from megarl.models.hf_config import load_hf_config

    hf_config = load_hf_config(model.local_path, trust_remote_code=model.trust_remote_code)
    family = family_for(hf_config)
    if model.lora_rank and family.vision is None:
        check_lora_rank(model.lora_spec, hf_config, model.path)
    if model.lora_rank and family.moe is not None:
        raise ValueError(f"actor_rollout_ref.model.lora_rank={model.lora_rank}: LoRA on mixture-of-experts models is "
                         f"not supported yet (actor_rollout_ref.model.path={model.path!r} is a {family.name} model, "
                         f"whose experts are grouped linears): set lora_rank=0")
    if family.vision is None:
        return
    refused = {"actor_rollout_ref.model.lora_rank": model.lora_rank,
               "actor_rollout_ref.actor.parallel.cp": cfg.actor_rollout_ref.actor.parallel.cp > 1,
               "critic.parallel.cp": cfg.critic.enable and cfg.critic.parallel.cp > 1,
               "teacher.enable": cfg.teacher.enable, "reward_model.enable": cfg.reward_model.enable}
    for key, on in refused.items():
        if on:
            raise ValueError(f"{key}: not supported yet with a vision-language policy (actor_rollout_ref.model.path="
                             f"{model.path!r} is a {family.name} model); turn it off (docs/training.md, "
                             f"'Vision-language models')")


def lora_widths(hf_config, modules: Sequence[str]) -> dict[str, int]:
    """The narrower side (``min(in, out)``) of each adapted HF module of a decoder with ``hf_config``'s sizes."""
    hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    ffn = int(hf_config.intermediate_size)
    sides = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
             "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, ffn),
             "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}
    return {m: min(sides[m]) for m in modules}


def check_lora_rank(spec, hf_config, path: str) -> None:
    """Refuse a LoRA rank above an adapted layer's narrower side: ``B A`` of rank ``r`` over a layer of width
    ``w < r`` has rank ``w`` at most, so the extra rows and columns are memory and compute for nothing (a rank of
    100 000 on a 64-wide model took the machine's memory minutes later, naming nothing)."""
    widths = lora_widths(hf_config, spec.hf_target_modules)
    module, width = min(widths.items(), key=lambda item: item[1])
    if spec.rank > width:
        raise ValueError(f"actor_rollout_ref.model.lora_rank={spec.rank} is above the width of the adapted "
                         f"{module} ({width} of actor_rollout_ref.model.path={path!r}): an adapter's rank is at most "
                         f"its layer's narrower side; set lora_rank <= {width} (typically 8-64), or leave {module} "
                         f"out of actor_rollout_ref.model.target_modules")


def routing_shape(cfg: RunConfig) -> tuple[int, int] | None:
    """``(num_hidden_layers, top_k)`` of the policy when ``actor.router_replay`` is on (the shape of each token's
    routed experts the engines return), None when off; refuses a dense policy, naming the key."""
    replay = cfg.actor_rollout_ref.actor.router_replay
    if not replay.enabled:
        return None
    from megarl.models import family_for
    from megarl.models.hf_config import load_hf_config

    model = cfg.actor_rollout_ref.model
    hf_config = load_hf_config(model.local_path, trust_remote_code=model.trust_remote_code)
    family = family_for(hf_config)
    if family.moe is None:
        raise ValueError(f"actor_rollout_ref.actor.router_replay.mode={replay.mode} needs a mixture-of-experts policy; "
                         f"actor_rollout_ref.model.path={model.path!r} is a {family.name} model: set the mode to off")
    return int(hf_config.num_hidden_layers), family.moe.topk(hf_config)
