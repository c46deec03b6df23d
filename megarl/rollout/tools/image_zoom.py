"""``image_zoom_in_tool``: the model asks for a region of the row's image and is shown it (a vision-language policy's
multi-turn tool, as verl's ``ImageZoomInTool``).

- ``create(instance_id, image=...)``: the row's image (``tools_kwargs.image_zoom_in_tool.create_kwargs.image``:
  bytes, a path, a base64 data URI or ``{"bytes"}`` / ``{"path"}``, as the ``images`` column holds them) is required.
- ``execute(instance_id, {"bbox_2d": [x1, y1, x2, y2], "label": ...})``: the box (pixels of the image) is clipped
  to the image and grown around its centre to at least ``min_size`` pixels a side (default 28: one merged patch of
  Qwen2.5-VL), then cropped: the response is a :class:`~megarl.rollout.tools.base.ToolResponse` with the crop and
  ``"Zoomed in on the image to the region [x1, y1, x2, y2] with label <label>."``; step reward 0. A box that is not
  four numbers, or empty after clipping, is answered with an error text and a step reward of ``-penalty``
  (default 0.05), counted in the metrics (``invalid_box``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megarl.rollout.tools.base import BaseTool, ToolResponse, ToolResult

CONFIG_KEYS = ("type", "min_size", "penalty")
"""Settings of the tool's ``config``: ``type`` (native), ``min_size`` (pixels), ``penalty``."""


def zoom_box(box: Any, width: int, height: int, min_size: int) -> tuple[int, int, int, int] | None:
    """``box`` ``[x1, y1, x2, y2]`` clipped to a ``width × height`` image and grown around its centre to at least
    ``min_size`` a side (never past the image); None when it is not four numbers or is empty after clipping."""
    if not isinstance(box, Sequence) or isinstance(box, str) or len(box) != 4:
        return None
    try:
        x1, y1, x2, y2 = (float(v) for v in box)
    except (TypeError, ValueError):
        return None
    x1, x2 = sorted((min(max(x1, 0.0), width), min(max(x2, 0.0), width)))
    y1, y2 = sorted((min(max(y1, 0.0), height), min(max(y2, 0.0), height)))
    if x2 - x1 < 1 or y2 - y1 < 1:
        return None
    out = []
    for low, high, size in ((x1, x2, width), (y1, y2, height)):
        side = min(max(high - low, min_size), size)
        centre = (low + high) / 2
        start = min(max(centre - side / 2, 0.0), size - side)
        out.append((round(start), round(start + side)))
    (left, right), (top, bottom) = out
    return left, top, right, bottom


class ImageZoomTool(BaseTool):
    """Crops a region of the row's image for the model (see the module docstring)."""

    def __init__(self, config: Mapping[str, Any] | None, tool_schema: Mapping[str, Any]) -> None:
        super().__init__(config, tool_schema)
        unknown = sorted(set(self.config) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(f"unknown ImageZoomTool config keys {unknown}; known: {list(CONFIG_KEYS)}")
        self.min_size = int(self.config.get("min_size", 28))
        self.penalty = float(self.config.get("penalty", 0.05))
        if self.min_size < 1:
            raise ValueError(f"ImageZoomTool config min_size={self.min_size} must be >= 1")

    async def create(self, instance_id: str | None = None, image: Any = None, **create_kwargs: Any) -> str:
        """A trajectory over ``image`` (required: the row's image)."""
        from megarl.data.images import load_image

        if image is None:
            raise ValueError(f"tool {self.name!r} needs create_kwargs.image; set the row's extra_info.tools_kwargs."
                             f"{self.name}.create_kwargs.image (the image, as the images column holds it)")
        instance_id = await super().create(instance_id)
        self._instances[instance_id]["image"] = load_image(image, f"tool {self.name!r} create_kwargs.image")
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        """Crop ``parameters["bbox_2d"]``; see the module docstring for texts and step rewards."""
        image = self._instance(instance_id)["image"]
        box = zoom_box(parameters.get("bbox_2d"), image.width, image.height, self.min_size)
        if box is None:
            return (f"Error: bbox_2d must be four numbers [x1, y1, x2, y2] inside the {image.width} x {image.height} "
                    f"image, got {parameters.get('bbox_2d')!r}.", -self.penalty, {"invalid_box": 1.0})
        label = parameters.get("label", "")
        text = f"Zoomed in on the image to the region {list(box)}" + (f" with label {label}." if label else ".")
        return ToolResponse(text=text, images=[image.crop(box)]), 0.0, {"invalid_box": 0.0}
