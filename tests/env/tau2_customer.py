"""A rule-based customer for τ²'s user simulator: an OpenAI-compatible chat server (what litellm calls)
whose replies are fixed by what the agent last said, so τ² conversations in tests are deterministic.

τ² shows its user simulator the conversation with the roles flipped: the agent's messages are "user"
turns, the customer's own are "assistant" turns. The first agent message is τ²'s greeting."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

OPENING = "Hi, please create a task called 'Important Meeting' for user_1."
ANSWER = "My user id is user_1."  # to any question
BYE = "Thanks, that is all. ###STOP###"


def reply(messages: list[dict]) -> str:
    agent = [m.get("content") or "" for m in messages if m["role"] == "user"]
    if len(agent) <= 1:
        return OPENING
    return ANSWER if agent[-1].rstrip().endswith("?") else BYE


def app(delay_on: str = "stall", delay_s: float = 30.0) -> FastAPI:
    """The server; an agent message containing `delay_on` is answered after `delay_s` seconds."""
    api = FastAPI()
    api.state.requests = []

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        api.state.requests.append(body)
        agent = [m.get("content") or "" for m in body["messages"] if m["role"] == "user"]
        if agent and delay_on in agent[-1]:
            await asyncio.sleep(delay_s)
        message = {"role": "assistant", "content": reply(body["messages"])}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"], "choices": [choice]} | {
            "usage": usage
        }

    return api
