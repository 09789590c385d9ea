"""Format checks: did the response follow the tool-call and answer protocol?

Used as a small shaping term next to the outcome reward (as Agent-R1's format score): it rewards the
protocol, never the answer, so it cannot be farmed into accuracy.
"""

from __future__ import annotations

from agent_r1.env.tool_calls import ParseError, extract_answer, parse_tool_calls


def answer_format(text: str) -> float:
    """1.0 when the final response holds exactly one well-formed `<answer>` and no broken tool call."""
    if extract_answer(text) is None or text.count("<answer>") != 1:
        return 0.0
    return 0.0 if any(isinstance(c, ParseError) for c in parse_tool_calls(text)) else 1.0
