"""The calculator agent of sdk_agent.py written against the two other APIs harnesses speak, as their users
write them: Anthropic Messages with the `anthropic` SDK (ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the
environment), and OpenAI Responses with the `openai` SDK, continuing by `previous_response_id` (`--items`:
sending the whole conversation back as items instead, as a store=false client does). `--stream` streams
every answer. Run as `python -m tests.gateway.protocol_agents messages|responses [--stream] [--items]`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository root
from examples.calculator_agent import CALCULATOR, calculate

F = CALCULATOR["function"]


def messages(question: str, stream: bool) -> str:
    from anthropic import Anthropic

    client = Anthropic(max_retries=0)
    tools = [{"name": F["name"], "description": F["description"], "input_schema": F["parameters"]}]
    history: list[dict] = [{"role": "user", "content": question}]
    for _ in range(4):
        ask = dict(model="claude-sonnet-4-5", max_tokens=256, messages=history, tools=tools)
        if stream:
            with client.messages.stream(**ask) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**ask)
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text")
        history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        results = [
            {"type": "tool_result", "tool_use_id": u.id, "content": calculate(u.input["expression"])} for u in uses
        ]
        history.append({"role": "user", "content": results})
    return ""


def responses(question: str, stream: bool, items: bool) -> str:
    from openai import OpenAI

    client = OpenAI(max_retries=0)
    tools = [{"type": "function", "name": F["name"], "description": F["description"], "parameters": F["parameters"]}]
    conversation: list = [{"role": "user", "content": question}]
    previous = None
    for _ in range(4):
        ask = dict(model="gpt-5-mini", input=conversation, tools=tools, previous_response_id=previous, store=not items)
        if stream:
            with client.responses.stream(**ask) as events:
                reply = events.get_final_response()
        else:
            reply = client.responses.create(**ask)
        calls = [o for o in reply.output if o.type == "function_call"]
        if not calls:
            return reply.output_text
        outputs = [
            {
                "type": "function_call_output",
                "call_id": c.call_id,
                "output": calculate(json.loads(c.arguments)["expression"]),
            }
            for c in calls
        ]
        if items:  # the whole conversation each time
            conversation = [*conversation, *[o.model_dump(exclude_none=True) for o in reply.output], *outputs]
        else:  # only what is new, after the stored response
            conversation, previous = outputs, reply.id
    return ""


if __name__ == "__main__":
    task = json.loads(sys.stdin.readline())
    stream = "--stream" in sys.argv
    if sys.argv[1] == "messages":
        print(messages(task["question"], stream))
    else:
        print(responses(task["question"], stream, "--items" in sys.argv))
