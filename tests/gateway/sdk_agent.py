"""An agent written with the plain OpenAI SDK, as a user would write it: a calculator tool loop.

It knows nothing of agent-r1. The gateway tests run it as a command (`python sdk_agent.py`, the task as
a JSON line on stdin, OPENAI_BASE_URL and OPENAI_API_KEY from the environment) and as a function (`run`).
With `--rewrite` it drops its earlier assistant turns from the history it sends, as agents that trim or
summarise their context do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository root
from examples.calculator_agent import CALCULATOR, calculate  # the example agent's schema and tool

__all__ = ["CALCULATOR", "calculate", "run", "run_forced"]


def run(
    task: dict, base_url: str | None = None, api_key: str | None = None, rewrite: bool = False, force: bool = False
) -> str:
    """Ask, run the calculator for every call, ask again, until the model answers; return the answer. With
    `force`, the first request forces a tool call (`tool_choice="required"`)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": task["question"]}]
    for turn in range(4):
        choice = "required" if force and turn == 0 else "auto"
        reply = client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, tools=[CALCULATOR], tool_choice=choice
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))  # the SDK's own message, sent back as it came
        for call in message.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
        if rewrite:
            messages = [m for m in messages if m["role"] != "assistant"]
    return ""


def run_forced(task: dict, base_url: str | None = None, api_key: str | None = None) -> str:
    """`run`, its first request forcing a tool call."""
    return run(task, base_url, api_key, force=True)


if __name__ == "__main__":
    print(run(json.loads(sys.stdin.readline()), rewrite="--rewrite" in sys.argv))
