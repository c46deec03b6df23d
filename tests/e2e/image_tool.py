"""A tool that answers every call with an image and a text (a vision-language policy's multi-turn e2e test)."""

import io

import numpy as np

from megarl.rollout.tools.base import BaseTool, ToolResponse


class ImageTool(BaseTool):
    async def execute(self, instance_id, parameters, **execute_kwargs):
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(np.full((28, 28, 3), 200, dtype=np.uint8)).save(buffer, format="PNG")
        return ToolResponse(text="here it is", images=[buffer.getvalue()]), 0.0, {}
