"""OpenAI response bodies, built in one place for `agent-r1 serve` and the gateway: a chat.completion and its
choices, the chat.completion.chunk events of a stream, usage, per-token log-probs and the model list. Field
names and meanings are OpenAI's (https://platform.openai.com/docs/api-reference/chat/object); `token_ids`,
`prompt_token_ids` and `token_versions` are the extensions `RemoteEngine` reads (schema.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase


def head(kind: str, model: str) -> dict[str, Any]:
    """What every body and chunk of one response shares: its id (`chatcmpl-` or `cmpl-`), creation time, model."""
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_message(content: str | None, calls: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message of one choice: its content, and `tool_calls` when it wrote any."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def chat_choice(k: int, message: dict[str, Any], finish: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {
        "index": k,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish,
    }


def chat_completion(
    head: dict[str, Any], choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return head | {"object": "chat.completion", "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def token_logprobs(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], logprobs: Sequence[float]) -> list[dict]:
    """A chat choice's `logprobs.content`: each sampled token with its log-prob (no top alternatives)."""
    return [
        {"token": tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
        for t, lp in zip(ids, logprobs, strict=True)
    ]


def chat_chunk(head: dict[str, Any], k: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """One chat.completion.chunk event: choice k's `delta`, and its finish reason on its last chunk."""
    return head | {
        "object": "chat.completion.chunk",
        "choices": [{"index": k, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def last_delta(rest: str, calls: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The delta that ends a streamed choice: the content not sent yet, its tool calls whole, each with its index."""
    delta: dict[str, Any] = {"content": rest} if rest else {}
    if calls:
        delta["tool_calls"] = [c | {"index": i} for i, c in enumerate(calls)]
    return delta


async def chat_chunks(completion: dict[str, Any], include_usage: bool = False) -> AsyncIterator[dict[str, Any]]:
    """A whole chat.completion as OpenAI's stream, choice by choice: the role, the content, the tool calls, the
    finish reason; with `stream_options.include_usage`, a last chunk with no choices and the usage (null in the
    others)."""
    top = {k: completion[k] for k in ("id", "created", "model")} | ({"usage": None} if include_usage else {})
    for k, choice in enumerate(completion["choices"]):
        message = choice["message"]
        yield chat_chunk(top, k, {"role": "assistant", "content": ""})
        if message.get("content"):
            yield chat_chunk(top, k, {"content": message["content"]})
        if message.get("tool_calls"):
            yield chat_chunk(top, k, last_delta("", message["tool_calls"]))
        yield chat_chunk(top, k, {}, choice["finish_reason"])
    if include_usage:
        yield top | {"object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]}


async def first_choice(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[tuple[dict, str | None, dict | None]]:
    """Choice 0 of a chat.completion.chunk stream as (delta, finish_reason, usage): what the Messages and
    Responses streams are translated from; the last chunk, with the usage and no choices, is ({}, None, usage)."""
    async for chunk in chunks:
        if chunk["choices"]:
            choice = chunk["choices"][0]
            yield choice["delta"], choice.get("finish_reason"), None
        else:
            yield {}, None, chunk.get("usage")


def model_list(*cards: dict[str, Any]) -> dict[str, Any]:
    """GET /v1/models: each card gets OpenAI's `object` and `owned_by`."""
    return {"object": "list", "data": [{"object": "model", "owned_by": "agent-r1"} | c for c in cards]}
