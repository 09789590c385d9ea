"""An echo tool, the smallest real tool: tests give reward 1 only if its output shows it really ran."""

from __future__ import annotations

from agent_r1.tools.base import tool


@tool
def echo(text: str) -> str:
    """Return the given text unchanged.

    Args:
        text: The text to echo back.
    """
    return text
