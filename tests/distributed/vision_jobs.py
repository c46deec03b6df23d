"""Rank-side jobs for the vision-language tests (imported by spawned ranks): a tiny Qwen2.5-VL in Megatron at
several layouts against transformers."""

from __future__ import annotations

import numpy as np
import torch

LAYOUTS = {  # name -> (ParallelDims kwargs, packed), on 2 ranks
    "tp1_padded": (dict(), False),
    "tp1_packed": (dict(), True),
    "tp2_padded": (dict(tp=2), False),
    "tp2_sp_packed": (dict(tp=2, sequence_parallel=True), True),
    "pp2_padded": (dict(pp=2), False),
    "pp2_packed": (dict(pp=2), True),
}


def save_tiny_vl(directory, seed: int = 0, arch: str = "qwen2_5_vl"):
    """A tiny random Qwen2.5-VL or Qwen3-VL (fp32) and its tokenizer in ``directory``; returns the model."""
    from transformers import AutoModelForImageTextToText

    from megarl.models.tiny import save_tiny_vl as save

    save(directory, seed=seed, arch=arch)
    return AutoModelForImageTextToText.from_pretrained(directory).float().eval()


def image_batch(config, seed: int = 3) -> dict:
    """Four rows, left-padded: two images of different grids (4 × 6 and 6 × 4 patches) in the first, one image
    (2 × 2 patches) after text in the second, text alone in the third, and in the fourth an image whose response
    holds a placeholder token the model generated (text: ``generated_from`` is where the response starts); pixel
    values random."""
    gen = torch.Generator().manual_seed(seed)
    start, end, pad = config.vision_start_token_id, config.vision_end_token_id, config.image_token_id
    vision = config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size ** 2  # channels × temporal patch × patch × patch

    def image(h, w):
        return [start] + [pad] * (h * w // 4) + [end], torch.randn(h * w, patch, generator=gen), [1, h, w]

    def text(n):
        return torch.randint(3, 200, (n,), generator=gen).tolist()

    a, b, c, d = image(4, 6), image(6, 4), image(2, 2), image(4, 4)
    prompt = text(2) + d[0] + text(2)
    rows = [text(3) + a[0] + text(2) + b[0] + text(4), text(5) + c[0] + text(3), text(7),
            prompt + text(2) + [pad] + text(2)]
    inputs = [{"pixel_values": torch.cat([a[1], b[1]]), "image_grid_thw": torch.tensor([a[2], b[2]])},
              {"pixel_values": c[1], "image_grid_thw": torch.tensor([c[2]])}, None,
              {"pixel_values": d[1], "image_grid_thw": torch.tensor([d[2]])}]
    S = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, S - len(row):] = torch.tensor(row)
        mask[i, S - len(row):] = 1
    multi = np.empty(len(rows), dtype=object)
    for i, x in enumerate(inputs):
        multi[i] = x
    return {"input_ids": ids, "attention_mask": mask, "multi_modal_inputs": multi,
            "weights": torch.randn(len(rows), S, generator=gen), "generated_from": [None, None, None, len(prompt)]}


@torch.no_grad()
def hf_logits_and_positions(model, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each row's logits over its tokens from transformers (one row at a time, no padding), and its positions
    ``[S_i, 3]`` from transformers' ``get_rope_index``."""
    logits, positions = [], []
    image = model.config.image_token_id
    for i, inputs in enumerate(batch["multi_modal_inputs"]):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
        kwargs = {} if inputs is None else dict(inputs)
        start = batch["generated_from"][i]
        if start is None:
            types = (ids == image).int()
            logits.append(model(input_ids=ids, mm_token_type_ids=types, **kwargs).logits[0])
            grid = None if inputs is None else inputs["image_grid_thw"]
            positions.append(model.model.get_rope_index(ids, types, grid)[0][:, 0].T)
            continue
        # The prompt with its image, then the response on the cache without pixel values (as an engine decodes):
        # the generated placeholder is read as text.
        from transformers import DynamicCache

        prompt = ids[:, :start]
        types = (prompt == image).int()
        prompt_positions, _ = model.model.get_rope_index(prompt, types, inputs["image_grid_thw"])
        after = prompt_positions.max() + 1 + torch.arange(ids.shape[1] - start)
        cache = DynamicCache(config=model.config)
        head = model(input_ids=prompt, mm_token_type_ids=types, position_ids=prompt_positions, past_key_values=cache,
                     use_cache=True, **kwargs).logits[0]
        tail = model(input_ids=ids[:, start:], position_ids=after.view(1, 1, -1).expand(3, 1, -1),
                     past_key_values=cache, use_cache=True).logits[0]
        logits.append(torch.cat([head, tail]))
        positions.append(torch.cat([prompt_positions[:, 0].T, after[:, None].expand(-1, 3)]))
    return logits, positions


def _valid(mask: torch.Tensor) -> torch.Tensor:
    """Positions whose next token is real (each row's tokens end at the last column)."""
    valid = mask.float()
    valid[:, -1] = 0
    return valid


def loss_fn(logp, entropy, mb):
    """A weighted sum of next-token log-probs (what the gradients are compared on)."""
    return -(logp * mb["weights"] * _valid(mb["attention_mask"])).sum() / mb["weights"].numel(), {}


def hf_tower_grads(model, batch: dict) -> dict[str, torch.Tensor]:
    """The vision tower's gradients of :func:`loss_fn` from transformers (row by row)."""
    model.zero_grad()
    image, total = model.config.image_token_id, 0.0
    for i, inputs in enumerate(batch["multi_modal_inputs"]):
        if batch["generated_from"][i] is not None:  # weighted 0 (image_batch's caller): no gradient
            continue
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        kwargs = {} if inputs is None else dict(inputs)
        logits = model(input_ids=ids, mm_token_type_ids=(ids == image).int(), **kwargs).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        total = total - (logp * batch["weights"][i][keep][:-1]).sum() / batch["weights"].numel()
    total.backward()
    return {n: p.grad.clone() for n, p in model.model.visual.named_parameters() if p.grad is not None}


def layouts_job(hf_dir: str) -> dict:
    """Per layout: this rank's full logits (TP gathered; None off the last stage), and the vision tower's
    gradients of a weighted log-prob loss (None off the first stage)."""
    import torch.distributed as dist

    from megarl.convert import load_hf_into
    from megarl.models import build_model_chunks, family_for
    from megarl.models.hf_config import load_hf_config
    from megarl.parallel import ParallelDims, destroy_parallel, forward_backward, init_parallel
    from megarl.parallel.pipeline import MROPE_POSITIONS
    from megarl.workers.sharded_model import with_positions

    cfg = load_hf_config(hf_dir)
    family = family_for(cfg)
    batch = torch.load(f"{hf_dir}/batch.pt", weights_only=False)
    batch = with_positions([batch], family, cfg)[0]  # as the workers add them: positions, the image tokens
    out = {"positions": batch[MROPE_POSITIONS]}
    for name, (kwargs, packed) in LAYOUTS.items():
        groups = init_parallel(ParallelDims(**kwargs), seed=5)
        chunks = build_model_chunks(family, cfg, groups.dims)
        load_hf_into(chunks, hf_dir, family, groups, hf_config=cfg)
        result = forward_backward(chunks, [batch], forward_only=True, vocab_size=cfg.vocab_size, groups=groups,
                                  return_logits=True, packed=packed)
        logits = None
        if result:
            local = result[0]["logits"].contiguous()
            parts = [torch.empty_like(local) for _ in range(groups.dims.tp)]
            dist.all_gather(parts, local, group=groups.tp)
            logits = torch.cat(parts, dim=-1)[..., :cfg.vocab_size]
        forward_backward(chunks, [batch], loss_fn=loss_fn, vocab_size=cfg.vocab_size, groups=groups, packed=packed)
        tower = chunks[0].vision_model
        grads = None if tower is None else {n: p.grad.clone() for n, p in tower.named_parameters()
                                            if p.grad is not None}
        out[name] = {"logits": logits, "grads": grads, "pp_rank": groups.pp_rank,
                     "tower_params": sum(p.numel() for p in tower.parameters()) if tower is not None else 0}
        destroy_parallel()
    return out


def write_image_prompts(path, seed: int = 0) -> None:
    """A parquet file of image prompts in verl's format: two images in one row, one in another, text in a third."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(seed)

    def png(h, w):
        buffer = io.BytesIO()
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}

    rows = [("<image>How many? <image>", [png(60, 90), png(90, 60)]), ("What is in <image>?", [png(56, 56)]),
            ("What is 2 + 3?", None)]
    pq.write_table(pa.table({"data_source": ["squares"] * 3,
                             "prompt": [[{"role": "user", "content": text}] for text, _ in rows],
                             "images": [images for _, images in rows],
                             "reward_model": [{"ground_truth": "1", "style": "rule"}] * 3}), path)


def image_rollout(hf_dir: str, data_file: str, log_dir: str, *, n: int, temperature: float,
                  response_length: int = 8):
    """The image prompts of ``data_file`` rolled out by a CPU engine server behind sglang-router (seed 3), with
    GRPO advantages from a fake reward (1 when the first response token id is even)."""
    from transformers import AutoTokenizer

    from megarl.config import RolloutConfig
    from megarl.data.dataset import PromptDataset
    from megarl.data.images import ImageProcessor
    from megarl.models.hf_config import load_hf_config
    from megarl.rollout import RolloutManager
    from tests.distributed.actor_jobs import fake_grpo
    from tests.engine_servers import engine_servers

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    processor = ImageProcessor.from_pretrained(hf_dir, tokenizer, load_hf_config(hf_dir))
    dataset = PromptDataset(data_file, tokenizer, processor=processor, max_prompt_length=48)
    prompts = dataset.collate([dataset[i] for i in range(len(dataset))])
    config = RolloutConfig(n=n, temperature=temperature, seed=3)
    if temperature == 0:
        config = RolloutConfig(n=1, do_sample=False, seed=3)
    with engine_servers(hf_dir, log_dir, num_engines=1, seeds=[3], router=True) as servers:
        batch = RolloutManager(servers.generator, servers.engines, tokenizer, config, prompt_length=48,
                               response_length=response_length).generate(prompts)
    return fake_grpo(batch, prompts=len(dataset), n=config.n if temperature else 1)


def actor_job(hf_dir: str, batch, temperature: float, sync_cases: list) -> dict:
    """The Megatron actor (TP=2 × PP=2, packed) recomputes the rollout's log-probs, takes PPO steps, then syncs its
    weights (the vision tower's included) into a CPU engine server by each transport of ``sync_cases``
    (``(transport, engine fields)``), every tensor read whole from the engine on rank 0 (``/megarl/inspect_weight``:
    SGLang's Qwen2.5-VL answers no ``/get_weights_by_name``, so the transport reports the engine unverified)."""
    from megarl.algo.mismatch import mismatch_metrics
    from megarl.config import ActorConfig, OptimConfig
    from megarl.parallel import ParallelDims
    from megarl.workers.actor import ActorRole
    from megarl.workers.sharded_model import ShardedModel

    sharded = ShardedModel(hf_dir, ParallelDims(tp=2, pp=2), optim=OptimConfig(lr=2e-3, clip_grad=1.0), packed=True)
    actor = ActorRole(sharded, ActorConfig(ppo_mini_batch_size=len(batch) // 2, ppo_micro_batch_size_per_gpu=2,
                                          ppo_epochs=1, entropy_coeff=0.0))
    before = actor.compute_log_prob(batch, temperature=temperature)
    old = before["log_probs"] if before is not None else torch.zeros_like(batch["rollout_log_probs"])
    src = torch.distributed.get_global_rank(sharded.groups.pp, sharded.groups.dims.pp - 1)
    torch.distributed.broadcast(old, src=src, group=sharded.groups.pp)
    batch["old_log_probs"] = old
    steps = actor.update(batch, temperature=temperature)
    out = {"steps": [(s.applied, s.loss, s.grad_norm) for s in steps], "output_rank": before is not None,
           "sync": []}
    from megarl.engines import event_loop
    from megarl.engines.client import EngineAddress, gather_sync
    from megarl.engines.cpu_engine.read_back import inspect_weight
    from megarl.sync import make_transport

    exporter = sharded.exporter(torch.float32)
    names = [n for unit in exporter.units for n in unit.hf_names]
    for index, (name, fields) in enumerate(sync_cases):
        engines = [EngineAddress(**f) for f in fields]
        truth = {n: t.clone() for bucket in exporter.iter_full(1 << 20) for n, t in bucket}
        transport = make_transport(name, sharded.groups, engines, device="cpu")
        stats = transport.sync(exporter, bucket_bytes=1 << 16, version=f"v{index}", verify_names=names)
        transport.close()
        torch.distributed.barrier()
        differ = None
        if torch.distributed.get_rank() == 0:  # every tensor whole, as held (SGLang's VL models answer no read-back)
            with event_loop.holding():
                differ = [(e.name, n) for e in engines for n, t in truth.items()
                          if not torch.equal(gather_sync([inspect_weight(e.url, n)])[0].float(), t)]
        out["sync"].append((name, stats, len(names), sum(n.startswith("visual.") for n in names), differ))
        torch.distributed.barrier()
    if before is not None:
        out["mismatch"] = mismatch_metrics(batch["rollout_log_probs"], before["log_probs"],
                                           batch["response_mask"].float())
    return out


def layouts_jobs(hf_dirs: list[str]) -> list[dict]:
    """:func:`layouts_job` for each model directory, in one spawn."""
    return [layouts_job(hf_dir) for hf_dir in hf_dirs]
