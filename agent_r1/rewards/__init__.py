"""Reward functions: `(task, answer text) -> float`, or `-> (float, {metric: value})` to log parts."""

from agent_r1.rewards.format import answer_format
from agent_r1.rewards.numeric import last_number, numeric_match

__all__ = ["answer_format", "last_number", "numeric_match"]
