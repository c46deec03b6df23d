"""Rollout: engine protocol, engines, rollout manager, multi-turn agent loop, tools."""
