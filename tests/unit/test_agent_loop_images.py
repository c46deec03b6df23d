"""Multi-turn rollouts with images: a vision-language policy's prompt image and an image a tool returns
(``ToolResponse``) are placed in the conversation (each placeholder expanded to its merged patches, loss mask 0),
sent to the engine with every turn (``image_data``), and carried to the batch (``multi_modal_inputs``), where the
trainer's positions find exactly those images."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from megarl.config import MultiTurnConfig, RolloutConfig
from megarl.data.batch import Batch
from megarl.rollout.agent_loop import AgentLoop
from megarl.rollout.request import RequestState
from megarl.rollout.request_batch import batch_from_requests, requests_from_batch
from megarl.rollout.tools import BaseTool
from megarl.rollout.tools.base import ToolResponse
from tests.scripted_engine import ScriptedEngine

QUESTION = "How many red squares?"
CALL = '<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call>'
FINAL = "There are 3."


def _png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")).save(buffer, "PNG")
    return buffer.getvalue()


class ZoomTool(BaseTool):
    """Answers every call with a text and an image (``config["png"]``), or with an unreadable image."""

    async def execute(self, instance_id, parameters, **execute_kwargs):
        return ToolResponse(text="zoomed in", images=[self.config["png"]]), 0.0, {}


@pytest.fixture(scope="module")
def parts():
    from megarl.data.images import ImageProcessor, load_image
    from megarl.models.tiny import build_tiny_vl_tokenizer, tiny_image_processor, tiny_qwen2_5_vl_config
    from megarl.models.vision import model_config

    tokenizer = build_tiny_vl_tokenizer()
    config = model_config(tiny_qwen2_5_vl_config(tokenizer))
    processor = ImageProcessor(tiny_image_processor(), tokenizer, image_token_id=config.image_token_id,
                               vision_start_token_id=config.vision_start_token_id)
    prompt_image = load_image({"bytes": _png(28, 56, 0)}, "prompt")  # 2 merged patches
    return tokenizer, config, processor, prompt_image


def _loop(tokenizer, processor, png: bytes):
    schema = {"type": "function", "function": {"name": "zoom", "description": "Zoom in.",
                                               "parameters": {"type": "object", "properties": {}}}}
    engine = ScriptedEngine(tokenizer, {QUESTION: [CALL, FINAL]})
    config = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, format="qwen25",
                                                      tokenization_sanity_check="strict"))
    loop = AgentLoop(engine, tokenizer, config, prompt_length=512, response_length=512,
                     tools={"zoom": ZoomTool({"png": png}, schema)}, image_processor=processor)
    return loop, engine


def _run(loop, requests):
    import asyncio

    return asyncio.run(loop.run(requests))


def test_a_tool_image_joins_the_conversation_the_engine_and_the_batch(parts):
    from megarl.models import family_for

    tokenizer, config, processor, prompt_image = parts
    loop, engine = _loop(tokenizer, processor, _png(56, 56, 1))  # 4 merged patches
    prompts = Batch(non_tensors={
        "raw_prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]],
        "multi_modal_data": [{"image": [prompt_image]}]})
    (request,) = _run(loop, requests_from_batch(prompts, n=1))
    assert request.state is RequestState.COMPLETED, request.error
    pad, start, end = config.image_token_id, config.vision_start_token_id, config.vision_end_token_id
    ids, loss = request.input_ids, request.loss_mask
    # The prompt's image: 2 placeholders; the tool's, in the tool turn (loss 0): 4.
    runs = processor.image_runs(ids)
    assert [e - s for s, e in runs] == [2, 4] and all(ids[s - 1] == start and ids[e] == end for s, e in runs)
    tool_start = runs[1][0]
    assert tool_start > request.prompt_len and loss[tool_start - 1:runs[1][1] + 1] == [0] * 6
    assert sum(loss) == len(tokenizer.encode(CALL + "<|im_end|>" + FINAL + "<|im_end|>", add_special_tokens=False))
    # The engine got the prompt's image with turn 1 and both with turn 2, each turn's ids expanded.
    assert [len(images) for images in engine.images] == [1, 2]
    assert [len(processor.image_runs(call)) for call, _ in engine.calls] == [1, 2]
    # The batch carries both images' inputs; the trainer's positions find exactly their placeholders.
    batch = batch_from_requests([request], 512, 512, tokenizer.pad_token_id)
    inputs = batch["multi_modal_inputs"][0]
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 4]]
    assert inputs["pixel_values"].shape[0] == 8 + 16
    assert len(batch["multi_modal_data"][0]["image"]) == 2
    row = batch["input_ids"][0][batch["attention_mask"][0].bool()]
    _, is_image = family_for(config).vision.layout(config, row, inputs["image_grid_thw"])
    assert int(is_image.sum()) == 6 and torch.equal(row[is_image], torch.full((6,), pad))
    assert json.dumps(request.message_dicts()[2]["content"][0]) == '{"type": "image"}'


def test_an_unreadable_tool_image_is_answered_with_an_error(parts):
    tokenizer, _, processor, prompt_image = parts
    loop, engine = _loop(tokenizer, processor, b"not a png")
    prompts = Batch(non_tensors={
        "raw_prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]],
        "multi_modal_data": [{"image": [prompt_image]}]})
    (request,) = _run(loop, requests_from_batch(prompts, n=1))
    assert request.state is RequestState.COMPLETED and request.metrics["num_tool_bad_images"] == 1
    assert "the image cannot be decoded" in request.message_dicts()[2]["content"]
    assert [len(images) for images in engine.images] == [1, 1] and len(request.images) == 1


def test_a_text_policy_is_told_a_tool_image_cannot_be_shown(parts):
    from megarl.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    loop, engine = _loop(tokenizer, None, _png(28, 28, 2))
    prompts = Batch(non_tensors={"raw_prompt": [[{"role": "user", "content": QUESTION}]]})
    (request,) = _run(loop, requests_from_batch(prompts, n=1))
    assert request.metrics["num_tool_images_refused"] == 1 and engine.images == [None, None]
    assert "returned images, which this model cannot read" in request.message_dicts()[2]["content"]


def test_zoom_box_clips_and_grows_to_the_minimum():
    from megarl.rollout.tools.image_zoom import zoom_box

    assert zoom_box([10, 10, 20, 20], 100, 80, 28) == (1, 1, 29, 29)  # grown around its centre to 28
    assert zoom_box([90, 70, 200, 300], 100, 80, 28) == (72, 52, 100, 80)  # clipped, then grown inside
    assert zoom_box([0, 0, 100, 80], 100, 80, 28) == (0, 0, 100, 80)
    assert zoom_box([5, 5, 60, 40], 50, 30, 8) == (5, 5, 50, 30)
    for bad in ([1, 2, 3], "0,0,10,10", [0, 0, "x", 1], [200, 200, 300, 300]):
        assert zoom_box(bad, 100, 80, 28) is None


def test_the_zoom_tool_shows_the_model_a_region_of_its_image(parts):
    from pathlib import Path

    from megarl.rollout.tools import load_tools

    tokenizer, _, processor, _ = parts
    png = _png(56, 112, 4)  # 2 x 4 merged patches
    tools = load_tools(Path(__file__).resolve().parents[2] / "configs" / "tools" / "image_zoom_tool_config.yaml")
    call = '<tool_call>\n{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [60, 10, 100, 50]}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2]}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, {QUESTION: [call, bad, FINAL]})
    config = RolloutConfig(multi_turn=MultiTurnConfig(enable=True, format="qwen25", tokenization_sanity_check="strict"))
    loop = AgentLoop(engine, tokenizer, config, prompt_length=512, response_length=512, tools=tools,
                     image_processor=processor)
    prompts = Batch(non_tensors={
        "raw_prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]],
        "multi_modal_data": [{"image": [processor_image(png)]}],
        "tools_kwargs": [{"image_zoom_in_tool": {"create_kwargs": {"image": {"bytes": png}}}}]})
    (request,) = _run(loop, requests_from_batch(prompts, n=1))
    assert request.state is RequestState.COMPLETED, request.error
    assert [image.size for image in request.images] == [(112, 56), (40, 40)]  # the prompt's, then the crop
    assert "Zoomed in on the image to the region [60, 10, 100, 50]" in request.message_dicts()[2]["content"][1]["text"]
    assert "Error: bbox_2d must be four numbers" in request.message_dicts()[4]["content"]
    assert request.tool_metrics["image_zoom_in_tool"] == [{"step_reward": 0.0, "invalid_box": 0.0},
                                                          {"step_reward": -0.05, "invalid_box": 1.0}]
    assert [len(images) for images in engine.images] == [1, 2, 2]


def processor_image(png: bytes):
    from megarl.data.images import load_image

    return load_image({"bytes": png}, "prompt")
