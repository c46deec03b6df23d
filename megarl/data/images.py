"""Images in prompts: verl's dataset format, decoding, and the processor that turns them into model inputs.

verl's format: a row's images are a list in the ``images`` column (``data.image_key``), each a dict with
``bytes`` (an encoded PNG/JPEG, as ``datasets`` stores images in parquet) or ``path`` (a file), a path string,
or a ``data:image/...;base64,`` URI; the prompt's text marks where each one goes with ``<image>``, in order.
:func:`image_messages` turns such messages into chat content lists (``{"type": "image"}`` and ``{"type": "text"}``
items), which a vision-language chat template renders as ``<|vision_start|><|image_pad|><|vision_end|>``.

:class:`ImageProcessor` is the model's image processor (its ``preprocessor_config.json``, through transformers'
``AutoImageProcessor``) with the model's tokenizer: it gives the pixel values and patch grids of a prompt's
images and its token ids with each image's single placeholder expanded to one per merged patch (what the model
reads, and what a prompt's length counts); the rollout engines get the unexpanded ids and the images, and expand
them the same way.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

IMAGE_MARKER = "<image>"
"""Where a row's next image goes in its prompt text (verl's marker)."""
_MARKERS = re.compile(r"(<image>|<video>)")


class BadImage(ValueError):
    """An image that cannot be read: the row that holds it is skipped and counted, not a crash mid-run."""


@dataclasses.dataclass(frozen=True)
class SkippedRow:
    """A row the dataset skipped, where it was and why."""

    file: str
    row: int
    reason: str


MAX_IMAGE_PIXELS = 4096 * 4096
"""The most pixels an image may have (``data.max_image_pixels``'s default): its header is read first, and a larger
one is refused before it is decoded (a 144-megapixel PNG of 17 KB cost the driver 515 MB). Vision-language
processors resize far below it (Qwen2.5-VL's ``max_pixels``: 12.8 M)."""


def load_image(image: Any, where: str, *, base_dir: str | Path | None = None, max_pixels: int = MAX_IMAGE_PIXELS,
               paths: bool = True):
    """One image of a row (verl's forms: ``{"bytes"}``, ``{"path"}``, a path, a base64 data URI, a PIL image) as an
    RGB PIL image, fully decoded; :class:`BadImage` naming ``where`` when it is missing, corrupt, or larger than
    ``max_pixels`` (decompression bombs included). A relative path is read from ``base_dir`` (the data file's
    directory), not the working directory; ``paths=False`` refuses paths altogether (an engine's request)."""
    from PIL import Image, UnidentifiedImageError

    source = image
    if isinstance(image, dict):
        source = image.get("bytes") or image.get("path") or image.get("image")
        if source is None:
            raise BadImage(f"{where}: the image entry has neither 'bytes' nor 'path' (keys {sorted(image)})")
    try:
        if isinstance(source, Image.Image):
            opened = source
        elif isinstance(source, (bytes, bytearray)):
            opened = Image.open(io.BytesIO(source))
        elif isinstance(source, str) and source.startswith("data:image"):
            opened = Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1])))
        elif isinstance(source, (str, Path)):
            if not paths:
                raise BadImage(f"{where}: a file path; this engine takes images as data URIs or base64 only")
            path = Path(str(source).removeprefix("file://")).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = Path(base_dir) / path
            if not path.is_file():
                raise BadImage(f"{where}: the image file {str(path)!r} does not exist")
            opened = Image.open(path)
        else:
            raise BadImage(f"{where}: an image is a {type(source).__name__}; give bytes, a path or a base64 data URI")
        width, height = opened.size
        if width * height > max_pixels:
            raise BadImage(f"{where}: {width} x {height} = {width * height:,} pixels, above data.max_image_pixels="
                           f"{max_pixels:,} (refused before decoding it)")
        opened.load()
        return opened.convert("RGB")
    except UnidentifiedImageError as error:
        raise BadImage(f"{where}: the image cannot be decoded (not an image format PIL reads)") from error
    except Image.DecompressionBombError as error:
        raise BadImage(f"{where}: the image is a decompression bomb ({error})") from error
    except (OSError, ValueError, SyntaxError) as error:
        if isinstance(error, BadImage):
            raise
        raise BadImage(f"{where}: the image cannot be decoded ({type(error).__name__}: {error})") from error


def load_images(images: Any, where: str, *, base_dir: str | Path | None = None,
                max_pixels: int = MAX_IMAGE_PIXELS) -> list:
    """A row's images (its image column's value: a list, or None for none) as RGB PIL images (relative paths from
    ``base_dir``)."""
    if images is None:
        return []
    if not isinstance(images, Sequence) or isinstance(images, (str, bytes)):
        images = [images]
    return [load_image(image, f"{where} image {i}", base_dir=base_dir, max_pixels=max_pixels)
            for i, image in enumerate(images)]


def image_uri(image) -> str:
    """An RGB image as a base64 PNG data URI (how the rollout engines receive images: SGLang's ``image_data``)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_messages(messages: list[dict[str, Any]], num_images: int, where: str) -> list[dict[str, Any]]:
    """``messages`` with each ``<image>`` in a string content made an image item of a content list (text around it
    as text items), as vision-language chat templates take them; content lists are kept. The markers (and image
    items) must be as many as the row's images; ``<video>`` is refused."""
    out, count = [], 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and _MARKERS.search(content):
            items = []
            for piece in _MARKERS.split(content):
                if piece == "<video>":
                    raise ValueError(f"{where}: the prompt has a <video> marker; megarl's vision-language data takes "
                                     "images (give a video as frames, one <image> each)")
                if piece == IMAGE_MARKER:
                    items.append({"type": "image"})
                elif piece:
                    items.append({"type": "text", "text": piece})
            message = {**message, "content": items}
        if isinstance(message.get("content"), list):
            count += sum(1 for item in message["content"] if isinstance(item, dict) and item.get("type") == "image")
        out.append(message)
    if count != num_images:
        raise ValueError(f"{where}: the prompt marks {count} image(s) (<image> or image items) but the row has "
                         f"{num_images}; each image needs its marker, in order")
    return out


class ImageProcessor:
    """The model's image processor and tokenizer: pixel values, patch grids and expanded token ids of a prompt's
    images (see the module docstring)."""

    def __init__(self, image_processor: Any, tokenizer: Any, *, image_token_id: int,
                 vision_start_token_id: int | None = None):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token_id = int(image_token_id)
        self.vision_start_token_id = None if vision_start_token_id is None else int(vision_start_token_id)
        self.merge = int(getattr(image_processor, "merge_size", 1))

    @classmethod
    def from_pretrained(cls, path: str | Path, tokenizer: Any, hf_config, *, trust_remote_code: bool = False):
        """The processor of the model in ``path`` (its ``preprocessor_config.json``), for ``tokenizer``; ``hf_config``:
        megarl's view of its config (the image token)."""
        from transformers import AutoImageProcessor

        if not (Path(path) / "preprocessor_config.json").is_file():
            raise ValueError(f"{path} has no preprocessor_config.json: a vision-language model needs its image "
                             "processor next to its weights")
        return cls(AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code), tokenizer,
                   image_token_id=hf_config.image_token_id,
                   vision_start_token_id=getattr(hf_config, "vision_start_token_id", None))

    def image_tokens(self, image) -> int:
        """Placeholder tokens an image takes in the model's input (its merged patches)."""
        width, height = image.size
        return int(self.image_processor.get_number_of_image_patches(height, width, {})) // self.merge ** 2

    def pixels(self, images: list) -> dict[str, torch.Tensor]:
        """``pixel_values`` ``[patches, C·T·P·P]`` and ``image_grid_thw`` ``[images, 3]`` of ``images``."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def image_runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """``(start, end)`` of each image's placeholders in ``ids``: a run of placeholder tokens right after a
        vision-start token (SGLang's reading; a placeholder the model generated elsewhere is text), every run
        without a vision-start token configured."""
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == self.image_token_id and (self.vision_start_token_id is None
                                                  or (i > 0 and ids[i - 1] == self.vision_start_token_id)):
                end = i
                while end < len(ids) and ids[end] == self.image_token_id:
                    end += 1
                runs.append((i, end))
                i = end
            else:
                i += 1
        return runs

    def expand(self, ids: list[int], grid_thw: torch.Tensor) -> list[int]:
        """``ids`` with image ``k``'s placeholder run (:meth:`image_runs`: one placeholder, or already expanded)
        made ``t·h·w / merge²`` placeholders."""
        counts = (grid_thw.prod(-1) // self.merge ** 2).tolist()
        runs = self.image_runs(ids)
        if len(runs) != len(counts):
            raise ValueError(f"the prompt has {len(runs)} image placeholder(s) for its {len(counts)} image(s)")
        out, last = [], 0
        for (start, end), count in zip(runs, counts, strict=True):
            out += ids[last:start] + [self.image_token_id] * int(count)
            last = end
        return out + ids[last:]
