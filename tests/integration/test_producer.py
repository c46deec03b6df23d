"""The rollout producer (megarl.rollout.producer) against a real CPU engine server: groups in prompt order, seeded
by their place, generated ahead of the trainer within the staleness bound, versions per token."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from megarl.config import RolloutConfig
from megarl.convert.export import Bucket
from megarl.data.dataset import collate
from megarl.engines.client import run_sync
from megarl.models.tiny import build_tiny_model, build_tiny_tokenizer
from megarl.rollout.buffer import RolloutBuffer
from megarl.rollout.manager import RolloutManager
from megarl.rollout.producer import RolloutProducer
from megarl.seeds import derive_seed
from megarl.sync.base import flattened_payload
from tests.engine_servers import engine_servers, set_step_gate, wait_held_at_gate

P, R, N = 16, 6, 4
TEXTS = ["What is 3 + 4?", "Hi", "What is 21 + 5?", "#### 12", "system user", "The fox"]
BASE_SEED = 77


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def servers(tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("producer") / "model"
    model = build_tiny_model(tokenizer, seed=0)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    with engine_servers(directory, tmp_path_factory.mktemp("logs"), num_engines=1,
                        extra_args=("--enable-step-gate",)) as running:
        yield running, model


def prompts_of(tokenizer):
    def one(index: int):
        text = TEXTS[index % len(TEXTS)]
        batch = collate([{"input_ids": torch.tensor(tokenizer.encode(text)), "index": index}],
                        pad_token_id=tokenizer.pad_token_id, pad_to=P)
        batch["uid"] = np.array([f"g{index}"], dtype=object)
        return batch
    return one


def score(group):
    group["token_level_scores"] = torch.zeros(group["responses"].shape)
    return group


def set_version(engine, model, version: int) -> None:
    """A real weight update (the final norm, unchanged) that moves the engine to ``version``."""
    bucket = Bucket.pack([("model.norm.weight", model.model.norm.weight.detach().clone())], shared_memory=True)

    async def sync():
        await engine.begin_weight_update()
        await engine.update_weights_from_tensor([flattened_payload(bucket)], weight_version=str(version))
        await engine.end_weight_update()
    run_sync(sync())


def test_steps_get_their_prompts_groups_in_order_generated_ahead_within_the_bound(servers, tokenizer):
    running, model = servers
    engine = running.engines[0]
    manager = RolloutManager(engine, [engine], tokenizer, RolloutConfig(n=N), prompt_length=P, response_length=R)
    set_version(engine, model, 0)
    buffer = RolloutBuffer(groups_per_step=2, max_staleness=1)
    producer = RolloutProducer(manager, buffer, prompts_of=prompts_of(tokenizer), score=score, base_seed=BASE_SEED,
                               max_inflight=3)
    producer.start(0)
    try:
        steps = []
        for step in (1, 2, 3):
            batch = producer.take(step, timeout_s=120)
            steps.append(batch)
            if step == 1:  # the next step's groups were generated while "training": the bound allows 4 ahead
                deadline = time.monotonic() + 60
                while buffer.next_index < 4 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert buffer.next_index == 4  # and no further at version 0
            with producer.weight_update(step) as flush:
                assert flush and buffer.capacity(step - 1, 100) >= 0
                set_version(engine, model, step)
        for step, batch in enumerate(steps, start=1):
            groups = [2 * (step - 1), 2 * (step - 1) + 1]
            assert list(batch["uid"]) == [f"g{g}" for g in groups for _ in range(N)]  # whole groups, in order
            # Each group is what its own seed samples, whenever it was generated.
            for k, g in enumerate(groups):
                alone = manager.generate(prompts_of(tokenizer)(g), seed=derive_seed(BASE_SEED, g, 0))
                assert torch.equal(batch["responses"][k * N:(k + 1) * N], alone["responses"])
            versions = batch["rollout_weight_versions"]
            staleness = (step - 1) - int(versions[versions >= 0].min())
            assert 0 <= staleness <= 1, (step, staleness)
        assert producer.take_busy() > 0
    finally:
        producer.stop()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_partial_rollout_keeps_its_tokens_across_an_update_each_with_its_version(servers, tokenizer, mode):
    """Group 0 is stopped at its rows' HOLD-th token by the engine's step gate, the update pauses it there, and
    its rows finish after the update: each row's first HOLD tokens carry version 10, the rest 11."""
    running, model = servers
    engine = running.engines[0]
    long = 300
    manager = RolloutManager(engine, [engine], tokenizer, RolloutConfig(n=N), prompt_length=P, response_length=long)
    set_version(engine, model, 10)
    producer = RolloutProducer(manager, RolloutBuffer(groups_per_step=1, max_staleness=0),
                               prompts_of=prompts_of(tokenizer), score=score, base_seed=BASE_SEED, max_inflight=1,
                               partial_rollout=True, pause_mode=mode)
    hold = 5
    run_sync(set_step_gate(engine.url, hold))
    try:
        producer.start(10)
        run_sync(wait_held_at_gate(engine.url))  # group 0 is generating, held at its rows' 5th token
        with producer.weight_update(11) as flush:
            run_sync(set_step_gate(engine.url, None))  # the pause holds it from here
            assert flush is (mode == "retract")  # SGLang refuses to flush under held requests
            set_version(engine, model, 11)
        batch = producer.take(1, timeout_s=120)
    finally:
        run_sync(set_step_gate(engine.url, None))
        producer.stop()
    versions, mask = batch["rollout_weight_versions"], batch["response_mask"].bool()
    assert ((versions == -1) == ~mask).all()
    spanning = [row for row in range(N) if {10, 11} <= set(versions[row][mask[row]].tolist())]
    assert spanning, versions  # requests held across the update: earlier tokens 10, later ones 11
    for row in spanning:
        tokens = versions[row][mask[row]]
        assert (tokens[:hold] == 10).all() and (tokens[hold:] == 11).all()
    # A row that stopped before the gate has only version 10; every other row spans the update.
    assert all(row in spanning or int(mask[row].sum()) <= hold for row in range(N))


def test_a_groups_error_comes_back_from_take_and_stop_leaves_no_thread(servers, tokenizer):
    """The groups are tasks of the process's event loop: a scoring error reaches the trainer's take, and stop cancels
    what runs and joins the scoring thread (no thread of the producer outlives it)."""
    import threading

    running, model = servers
    engine = running.engines[0]
    manager = RolloutManager(engine, [engine], tokenizer, RolloutConfig(n=N), prompt_length=P, response_length=R)
    set_version(engine, model, 0)

    def failing(group):
        if group["uid"][0] == "g1":
            raise ValueError("no score for g1")
        return score(group)

    producer = RolloutProducer(manager, RolloutBuffer(groups_per_step=2, max_staleness=1),
                               prompts_of=prompts_of(tokenizer), score=failing, base_seed=BASE_SEED, max_inflight=2)
    producer.start(0)
    try:
        with pytest.raises(RuntimeError, match="asynchronous rollout failed: no score for g1"):
            producer.take(1, timeout_s=120)
    finally:
        producer.stop()
    producer.stop()  # idempotent
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("megarl-score", "megarl-rollout"))]
