"""A tool whose hooks hang on the rows that ask for it.

A row's ``tools_kwargs.hang.create_kwargs.hang`` names the hook that never returns in time:
``create`` and ``release`` block their thread (``time.sleep``, the mistake of calling blocking
code inside ``async def``), ``calc_reward`` awaits forever. Other rows behave: reward 1.
"""

import asyncio
import time

from megarl.rollout.tools.base import BaseTool

BLOCK_S = 20.0


class HangingTool(BaseTool):
    async def create(self, instance_id=None, hang=None, **create_kwargs):
        if hang == "create":
            time.sleep(BLOCK_S)
        instance_id = await super().create(instance_id)
        self._instances[instance_id]["hang"] = hang
        return instance_id

    async def execute(self, instance_id, parameters, **execute_kwargs):
        return "ok", 0.0, {}

    async def calc_reward(self, instance_id, **calc_reward_kwargs):
        if self._instance(instance_id)["hang"] == "calc_reward":
            await asyncio.Event().wait()
        return 1.0

    async def release(self, instance_id, **release_kwargs):
        hang = self._instances.get(instance_id, {}).get("hang")
        await super().release(instance_id)
        if hang == "release":
            time.sleep(BLOCK_S)
