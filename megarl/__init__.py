"""megarl: Megatron-Core RL trainer for LLMs (PPO, GRPO and relatives)."""

__version__ = "0.1.0"
