"""The calculator agent of sdk_agent.py written with smolagents: a `ToolCallingAgent` with a `@tool` calculator
on an `OpenAIServerModel` pointed at an OpenAI-compatible server by its base URL and key. smolagents adds its
own system prompt and a `final_answer` tool; the agent answers by calling it.

Run as a command (the task as a JSON line on stdin, OPENAI_BASE_URL and OPENAI_API_KEY from the
environment) or as a function (`run`). smolagents sends no telemetry of its own.
"""

from __future__ import annotations

import json
import os
import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from tests.gateway.sdk_agent import calculate


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Supports numbers, + - * / // % ** and parentheses (no variables or functions).

    Args:
        expression: The arithmetic expression, for example "(48 / 2) * 3 + 1".
    """
    return calculate(expression)


def run(task: dict, base_url: str | None = None, api_key: str | None = None) -> str:
    """The agent's answer to the task's question (None: OPENAI_BASE_URL and OPENAI_API_KEY)."""
    model = OpenAIServerModel(
        model_id="gpt-4o-mini",
        api_base=base_url or os.environ["OPENAI_BASE_URL"],
        api_key=api_key or os.environ["OPENAI_API_KEY"],
        client_kwargs={"max_retries": 0},
    )
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=3, verbosity_level=0)
    return str(agent.run(task["question"]))


if __name__ == "__main__":
    print(run(json.loads(sys.stdin.readline())))
