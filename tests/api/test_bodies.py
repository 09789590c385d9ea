"""OpenAI response bodies: a streamed completion is the whole one, chunk by chunk, as OpenAI's SDK reads it."""

from __future__ import annotations

import asyncio

from agent_r1.api import bodies


def test_chat_chunks_reassemble_into_the_completion_with_usage_last():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"x": 1}'}}]
    choices = [
        bodies.chat_choice(0, bodies.chat_message("Let me compute.", calls), "tool_calls"),
        bodies.chat_choice(1, bodies.chat_message("42", ()), "stop"),
    ]
    completion = bodies.chat_completion(bodies.head("chat", "m"), choices, 7, 5)
    assert completion["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert completion["id"].startswith("chatcmpl-") and completion["object"] == "chat.completion"

    async def collect():
        return [c async for c in bodies.chat_chunks(completion, include_usage=True)]

    chunks = asyncio.run(collect())
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == completion["id"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == completion["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])  # stream_options.include_usage: null until the last
    rebuilt = {}  # what a client accumulates from the deltas, choice by choice
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        got = rebuilt.setdefault(choice["index"], {"content": "", "tool_calls": [], "finish": None})
        got["content"] += choice["delta"].get("content", "")
        got["tool_calls"] += choice["delta"].get("tool_calls", [])
        got["finish"] = choice["finish_reason"] or got["finish"]
    assert rebuilt[0] == {"content": "Let me compute.", "tool_calls": [calls[0] | {"index": 0}], "finish": "tool_calls"}
    assert rebuilt[1] == {"content": "42", "tool_calls": [], "finish": "stop"}


def test_a_choice_without_calls_has_no_tool_calls_key_and_logprobs_nest_under_content():
    message = bodies.chat_message("hi", ())
    assert message == {"role": "assistant", "content": "hi"}
    lp = [{"token": "hi", "logprob": -0.5, "bytes": None, "top_logprobs": []}]
    assert bodies.chat_choice(0, message, "stop", lp)["logprobs"] == {"content": lp}
    assert bodies.chat_choice(0, message, "stop")["logprobs"] is None
    assert bodies.model_list({"id": "m", "created": 0})["data"] == [
        {"object": "model", "owned_by": "agent-r1", "id": "m", "created": 0}
    ]
