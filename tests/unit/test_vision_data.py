"""Image prompts in verl's format: images decoded and checked per row before training, prompt lengths
counted with each image's tokens, the model's inputs (expanded placeholders, pixel values, patch grids) and the
engine's (one placeholder per image, the images)."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch


def _png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import save_tiny_vl

    return save_tiny_vl(tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="module")
def processor(model_dir):
    from transformers import AutoTokenizer

    from megarl.data.images import ImageProcessor
    from megarl.models.hf_config import load_hf_config

    return ImageProcessor.from_pretrained(model_dir, AutoTokenizer.from_pretrained(model_dir),
                                          load_hf_config(model_dir))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_data")
    (root / "square.png").write_bytes(_png(60, 90, 1))
    rows = [
        ("<image>How many squares?", [{"bytes": _png(60, 90, 0), "path": None}]),  # 2 x 3 merged patches
        ("Count them: <image> and <image>", [{"bytes": None, "path": str(root / "square.png")},
                                             {"bytes": _png(600, 900, 2), "path": None}]),  # 6 and 12 tokens
        ("<image>broken", [{"bytes": b"not an image", "path": None}]),
        ("<image>gone", [{"bytes": None, "path": str(root / "missing.png")}]),
        ("<image><image>one image for two markers", [{"bytes": _png(60, 90, 3), "path": None}]),
        ("text alone", None),
    ]
    table = pa.table({
        "data_source": ["squares"] * len(rows),
        "prompt": [[{"role": "user", "content": text}] for text, _ in rows],
        "images": [images for _, images in rows],
        "reward_model": [{"ground_truth": "1", "style": "rule"}] * len(rows),
    })
    path = root / "train.parquet"
    pq.write_table(table, path)
    return path


def _dataset(data_file, processor, **kwargs):
    from megarl.data.dataset import PromptDataset

    return PromptDataset(str(data_file), processor.tokenizer, processor=processor, **kwargs)


def test_unreadable_images_skip_their_rows_counted_and_named(data_file, processor):
    dataset = _dataset(data_file, processor, max_prompt_length=256)
    assert dataset.num_rows_read == 6 and len(dataset) == 3 and dataset.num_skipped == 3
    reasons = {skip.row: skip.reason for skip in dataset.skipped}
    assert set(reasons) == {2, 3, 4}
    assert "row 2 image 0: the image cannot be decoded" in reasons[2]
    assert "row 3 image 0: the image file" in reasons[3] and "missing.png" in reasons[3]
    assert "row 4: the prompt marks 2 image(s)" in reasons[4] and "has 1" in reasons[4]


def test_image_rows_give_the_model_and_the_engine_their_inputs(data_file, processor):
    dataset = _dataset(data_file, processor, max_prompt_length=256)
    pad = processor.image_token_id
    first, second, text = dataset[0], dataset[1], dataset[2]
    assert first["raw_prompt_ids"].count(pad) == 1 and first["input_ids"].tolist().count(pad) == 6
    assert second["raw_prompt_ids"].count(pad) == 2 and second["input_ids"].tolist().count(pad) == 6 + 12
    assert second["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 6, 8]]
    assert second["multi_modal_inputs"]["pixel_values"].shape == (24 + 48, 3 * 2 * 14 * 14)
    assert [im.size for im in second["multi_modal_data"]["image"]] == [(90, 60), (900, 600)]
    # Expanding the engine's ids gives the model's: the same prompt either way.
    assert processor.expand(second["raw_prompt_ids"], second["multi_modal_inputs"]["image_grid_thw"]) == \
        second["input_ids"].tolist()
    assert text["multi_modal_inputs"] is None and text["multi_modal_data"] is None
    assert text["raw_prompt_ids"] == text["input_ids"].tolist()
    batch = dataset.collate([first, second, text])
    assert batch["input_ids"].shape == (3, 256) and batch["multi_modal_inputs"][2] is None
    assert torch.equal(batch["multi_modal_inputs"][1]["image_grid_thw"], second["multi_modal_inputs"]["image_grid_thw"])


def test_prompt_lengths_count_the_image_tokens(data_file, processor):
    dataset = _dataset(data_file, processor, max_prompt_length=256)
    lengths = {i: len(dataset[i]["input_ids"]) for i in range(len(dataset))}
    # The two-image row is the only one past 30 tokens, by its 18 image tokens: it is dropped at 30.
    assert lengths[1] > 30 >= lengths[1] - 16 and max(lengths[0], lengths[2]) <= 30
    shorter = _dataset(data_file, processor, max_prompt_length=30)
    assert len(shorter) == 2 and [p.row for p in shorter.filtered_overlong] == [1]
    assert shorter.filtered_overlong[0].num_tokens == lengths[1]
    unfiltered = _dataset(data_file, processor, max_prompt_length=30, filter_overlong_prompts=False,
                          truncation="left")
    with pytest.raises(ValueError, match="row 1: the templated prompt and its images take .* cannot be truncated"):
        unfiltered[1]


def test_a_text_model_refuses_a_file_with_images(data_file, processor):
    from megarl.data.dataset import PromptDataset

    with pytest.raises(ValueError, match="column 'images' \\(data.image_key\\) holds images, but the model"):
        PromptDataset(str(data_file), processor.tokenizer, max_prompt_length=256)
    assert len(PromptDataset(str(data_file), processor.tokenizer, max_prompt_length=256, image_key=None)) == 6


def test_image_rows_written_as_json_read_back_with_their_images(data_file, processor, tmp_path):
    """``megarl-generate`` writes its prompt rows back with the responses: to JSON, an image's bytes become a base64
    data URI, which the dataset reads as the same image."""
    from megarl.data.files import read_table, write_rows

    rows = read_table(data_file).to_pylist()[:2]
    write_rows(rows, tmp_path / "out.jsonl")
    back = _dataset(tmp_path / "out.jsonl", processor, max_prompt_length=256)
    original = _dataset(data_file, processor, max_prompt_length=256)
    for i in range(2):
        assert back[i]["input_ids"].tolist() == original[i]["input_ids"].tolist()
        assert torch.equal(back[i]["multi_modal_inputs"]["pixel_values"], original[i]["multi_modal_inputs"]["pixel_values"])


def _huge_png(width: int, height: int) -> bytes:
    """A PNG of ``width`` x ``height`` black pixels that compresses to a few KB (a decompression bomb's shape)."""
    import struct
    import zlib

    raw = zlib.compress(b"".join(b"\0" + bytes(width) for _ in range(height)), 9)  # filter 0, grayscale 8-bit

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def test_oversized_images_and_bombs_skip_their_rows_before_decoding(tmp_path, processor):
    """A 12000 x 12000 PNG (a few hundred KB, 144 megapixels: 515 MB decoded on the driver) is refused from its
    header at data.max_image_pixels, and PIL's decompression bomb (beyond 2 x its own limit) is a skipped row, not a
    traceback; relative image paths are read from the data file's directory, not the working directory."""
    from PIL import Image

    from megarl.data.images import BadImage, load_image

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "small.png").write_bytes(_png(30, 40, 5))
    big = _huge_png(12000, 12000)
    assert len(big) < 1_000_000
    rows = [("<image>big", [{"bytes": big, "path": None}]),
            ("<image>relative", [{"bytes": None, "path": "pics/small.png"}])]
    table = pa.table({"data_source": ["squares"] * 2, "prompt": [[{"role": "user", "content": t}] for t, _ in rows],
                      "images": [i for _, i in rows], "reward_model": [{"ground_truth": "1", "style": "rule"}] * 2})
    pq.write_table(table, tmp_path / "train.parquet")
    dataset = _dataset(tmp_path / "train.parquet", processor, max_prompt_length=256)
    assert len(dataset) == 1 and dataset.num_skipped == 1
    (skip,) = dataset.skipped
    assert skip.row == 0 and "12000 x 12000 = 144,000,000 pixels, above data.max_image_pixels=16,777,216" in skip.reason
    assert dataset[0]["multi_modal_data"]["image"][0].size == (40, 30)
    limit = Image.MAX_IMAGE_PIXELS
    with pytest.raises(BadImage, match="decompression bomb"):
        load_image(_huge_png(20000, 20000), "row 7", max_pixels=10 ** 12)  # past PIL's own 2 x limit
    assert Image.MAX_IMAGE_PIXELS == limit


def test_the_engine_takes_no_file_paths_in_image_data(tmp_path):
    """The engine's /generate reads data URIs and base64 only: a path is refused the same way whether the file
    exists, is unreadable or is missing (an open route must not read, or tell apart, the machine's files)."""
    from megarl.engines.cpu_engine.requests import RequestError, row_images

    (tmp_path / "real.png").write_bytes(_png(20, 20, 1))
    messages = []
    for path in (tmp_path / "real.png", tmp_path / "missing.png", "/etc/shadow"):
        with pytest.raises(RequestError) as refused:
            row_images([str(path)], 1, batched=True, multimodal=True)
        messages.append(str(refused.value).replace(str(path), "PATH"))
    assert len(set(messages)) == 1 and "neither a data URI nor base64" in messages[0]
    import base64

    (image,), = row_images([base64.b64encode(_png(20, 20, 1)).decode()], 1, batched=True, multimodal=True)
    assert image.size == (20, 20)
