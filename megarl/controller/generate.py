"""Generation only (``megarl-generate``, verl's ``main_generation``): responses for a file of prompts.

The prompts of ``data.train_files`` are read as training reads them (``data.prompt_key``, the chat template,
``data.max_prompt_length`` and its filter, whose dropped rows are counted and reported); the engines of
``actor_rollout_ref.rollout`` start from ``actor_rollout_ref.model.path`` (no actor is built: each engine has its
GPUs to itself), behind sglang-router as in training, and sample ``generation.n_samples`` responses per prompt
(else ``rollout.n``) with the rollout's sampling settings, ``generation.batch_size`` prompts a round, each round
seeded from ``trainer.seed``. The kept rows are written to ``generation.output_path`` as they were read, with a
``responses`` column: the list of a row's decoded responses (special tokens removed), as verl writes it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from megarl.config.schema import RunConfig
from megarl.controller.build import build_datasets, build_roles, build_rollout_manager, init_ray, load_agent_plugins
from megarl.controller.interrupts import interrupts_deferred
from megarl.controller.progress import Phases
from megarl.controller.run_inputs import check_run_inputs, prepare_policy
from megarl.data.files import write_rows
from megarl.seeds import SEED_STREAM_GENERATION, derive_seed


class GenerationInputError(ValueError):
    """An input of the generation (the config's files and directories) is missing or wrong: the message names it."""


@dataclasses.dataclass
class GenerationSummary:
    """What a generation wrote."""

    output_path: str
    prompts: int
    """Rows written (the prompts kept)."""
    responses: int
    """Responses generated (``prompts × n``)."""
    prompts_dropped: int
    """Rows left out by ``data.filter_overlong_prompts`` (longer than ``data.max_prompt_length``)."""
    seconds: float


def generate_responses(cfg: RunConfig, console=print) -> GenerationSummary:
    """Run a generation (see the module docstring); every process it starts has ended when it returns."""
    gen = cfg.generation
    if gen.output_path is None:
        raise GenerationInputError("generation.output_path is not set: name the file to write (.parquet, .json or .jsonl; "
                         "verl's data.output_path)")
    output = Path(gen.output_path).expanduser()
    if not output.parent.is_dir():
        raise GenerationInputError(f"generation.output_path={gen.output_path}: its directory {output.parent} does not exist")
    n = gen.n_samples or cfg.actor_rollout_ref.rollout.n
    sampling = cfg.actor_rollout_ref.rollout
    if n > 1 and (sampling.temperature == 0 or not sampling.do_sample):
        raise GenerationInputError(f"generation.n_samples={n} with greedy decoding (actor_rollout_ref.rollout."
                                   f"temperature=0 or do_sample=false) gives {n} identical responses: set "
                                   f"generation.n_samples=1 (verl's data.n_samples), or sample")
    rollout = dataclasses.replace(cfg.actor_rollout_ref.rollout, n=n)
    cfg = dataclasses.replace(cfg, actor_rollout_ref=dataclasses.replace(cfg.actor_rollout_ref, rollout=rollout),
                              data=dataclasses.replace(cfg.data, val_files=[]))
    started = time.perf_counter()
    phases = Phases(console)
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    try:
        with phases("checking the inputs" + (" and the tiny warm start" if model.init == "tiny_sft" else "")):
            check_run_inputs(cfg)
            prepare_policy(cfg, scoring=False)
        tokenizer = AutoTokenizer.from_pretrained(model.local_tokenizer_path,
                                                  trust_remote_code=model.trust_remote_code)
        plugins = load_agent_plugins(cfg)
        prompts, _ = build_datasets(cfg, tokenizer, plugins, console=console)
    except (ValueError, FileNotFoundError) as error:
        raise GenerationInputError(str(error)) from error
    _check_output(cfg, prompts, output)
    _check_writable(prompts, output)
    ray = roles = manager = None
    try:
        with interrupts_deferred("Ray has started"), phases("starting Ray"):  # then the finally below stops it
            ray = init_ray(cfg, console=console)
        log_dir = output.parent / f".{output.name}.logs"  # the engine servers' and the router's logs
        log_dir.mkdir(exist_ok=True)
        roles = build_roles(cfg, log_dir, phase=phases, training=False)
        manager = build_rollout_manager(cfg, roles.generator, roles.engines, tokenizer, plugins)
        rows = []
        with phases(f"generating {n} response(s) for each of {len(prompts)} prompt(s)"):
            for round_, start in enumerate(range(0, len(prompts), gen.batch_size)):
                items = range(start, min(start + gen.batch_size, len(prompts)))
                out = manager.generate(prompts.collate([prompts[i] for i in items]),
                                       seed=derive_seed(cfg.rollout_seed, SEED_STREAM_GENERATION, round_))
                texts = decode_responses(out, tokenizer)
                for offset, item in enumerate(items):  # a prompt's n rows are adjacent
                    rows.append(prompts.source_row(item) | {"responses": texts[offset * n:(offset + 1) * n]})
                console(f"  {len(rows)} of {len(prompts)} prompts")
        write_rows(rows, output)
    finally:
        if manager is not None:
            manager.close()
        if roles is not None:
            roles.shutdown()
        if ray is not None:
            ray.shutdown()
    summary = GenerationSummary(str(output), len(rows), len(rows) * n, prompts.num_filtered_overlong,
                                time.perf_counter() - started)
    console(f"wrote {summary.prompts} prompts with {n} response(s) each to {summary.output_path} "
            f"({summary.prompts_dropped} dropped as longer than data.max_prompt_length; {summary.seconds:.0f} s)")
    return summary


def _check_output(cfg: RunConfig, prompts, output: Path) -> None:
    """Before Ray: never write over an input (the prompts a filter dropped would be lost with it), over another
    existing file only with ``generation.overwrite``; prompts that already hold responses are refused, naming the
    file."""
    inputs = [Path(f).expanduser() for f in cfg.data.train_files]
    for index, source in enumerate(inputs):
        if output.exists() and source.exists() and output.resolve() == source.resolve():
            raise GenerationInputError(f"generation.output_path={output} is data.train_files[{index}], the prompts "
                                       f"it reads: megarl-generate never writes over its input; name another file")
    if output.exists() and not cfg.generation.overwrite:
        raise GenerationInputError(f"generation.output_path={output} exists: set generation.overwrite=true to "
                                   f"replace it, or name another file")
    if len(prompts) and "responses" in prompts.source_row(0):
        raise GenerationInputError(f"data.train_files={[str(f) for f in inputs]}: the rows already have a "
                                   f"'responses' column (megarl-generate's output?), which megarl-generate writes; "
                                   f"point data.train_files at the prompts, or drop the column")


def _check_writable(prompts, output: Path) -> None:
    """Parquet holds one type per column: refuse, before generating, prompt files whose columns differ in type."""
    if output.suffix.lower() != ".parquet":
        return
    import pyarrow as pa

    try:
        pa.Table.from_pylist([prompts.source_row(i) for i in range(len(prompts))])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise GenerationInputError(f"generation.output_path={output}: the prompts' rows cannot share one parquet "
                                   f"schema ({error}; files of data.train_files differ in a column's type): "
                                   f"write .jsonl or .json instead") from error


def decode_responses(batch, tokenizer) -> list[str]:
    """Each row's response tokens (up to its last real one), decoded without special tokens."""
    valid = batch["attention_mask"][:, -batch["responses"].shape[1]:]
    return tokenizer.batch_decode([r[: int(m.sum())] for r, m in zip(batch["responses"].tolist(), valid)],
                                  skip_special_tokens=True)
