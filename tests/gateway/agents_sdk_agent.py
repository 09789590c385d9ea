"""The calculator agent of sdk_agent.py written with the OpenAI Agents SDK (`openai-agents`), as a user points
it at an OpenAI-compatible server: its Chat Completions model on an `AsyncOpenAI` client with that server's
base URL and key (`--responses`: the SDK's default model, which speaks the Responses API), and its tracing
off (it would upload every run to OpenAI).

Run as a command (the task as a JSON line on stdin, OPENAI_BASE_URL and OPENAI_API_KEY from the
environment) or as a function (`run`).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

from tests.gateway.sdk_agent import CALCULATOR, calculate

set_tracing_disabled(True)  # no trace upload to OpenAI (OPENAI_AGENTS_DISABLE_TRACING=1 does the same)


async def _calculator(context: Any, arguments: str) -> str:
    return calculate(json.loads(arguments or "{}").get("expression", ""))


# the same schema as sdk_agent's, as given (strict_json_schema=False: the SDK would otherwise add
# "additionalProperties": false to it and send "strict": true)
calculator = FunctionTool(
    name=CALCULATOR["function"]["name"],
    description=CALCULATOR["function"]["description"],
    params_json_schema=CALCULATOR["function"]["parameters"],
    on_invoke_tool=_calculator,
    strict_json_schema=False,
)


def run(task: dict, base_url: str | None = None, api_key: str | None = None, responses: bool = False) -> str:
    """The agent's answer to the task's question (None: OPENAI_BASE_URL and OPENAI_API_KEY)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    model = kind(model="gpt-4o-mini", openai_client=client)
    agent = Agent(name="calculator", model=model, tools=[calculator])
    result = asyncio.run(Runner.run(agent, task["question"], max_turns=4))
    return str(result.final_output)


if __name__ == "__main__":
    print(run(json.loads(sys.stdin.readline()), responses="--responses" in sys.argv))
