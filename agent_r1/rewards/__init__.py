"""Reward functions: (task, answer text) -> float."""

from agent_r1.rewards.numeric import last_number, numeric_match

__all__ = ["last_number", "numeric_match"]
