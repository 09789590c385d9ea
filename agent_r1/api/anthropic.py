"""Anthropic's Messages API (https://docs.anthropic.com/en/api/messages) as a second face of the one chat
pipeline, for harnesses that speak it (Claude Code, OpenClaw's Anthropic provider):

* `to_chat`: a Messages request -> the chat request it means (system blocks -> a system message, `tool_use`
  blocks -> `tool_calls`, `tool_result` blocks -> tool messages, `input_schema` -> `parameters`,
  `tool_choice` any / tool -> required / a named function). Rendering, tool-call parsing and token
  bookkeeping stay in one place (messages.py), so a Messages episode merges and trains exactly as a chat one.
* `message`: the chat.completion the server answers -> an Anthropic Message (text and `tool_use` blocks,
  `stop_reason`, usage).
* `events`: a chat.completion.chunk stream -> Anthropic's stream (message_start, content_block_start /
  delta / stop, message_delta, message_stop), as the `anthropic` SDK accumulates it.
* `error_body`: an `APIError` as Anthropic's `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent_r1.api import bodies
from agent_r1.api.schema import APIError, ChatCompletionRequest, bounded_stops

Chat = TypeVar("Chat", bound=ChatCompletionRequest)
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}  # chat finish_reason -> stop_reason; else end_turn
ERROR_TYPES = {  # HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error",
}  # fmt: skip


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant", "system"]  # system: mid-conversation instructions (Claude Code sends them)
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """POST /v1/messages. Unknown fields (metadata, thinking, cache_control, service_tier) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False

    _bounded = field_validator("stop_sequences")(bounded_stops)


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without `max_tokens`."""

    max_tokens: int = 1


def to_chat(body: MessagesRequest, cls: type[Chat]) -> Chat:
    """The chat request (of the server's own request class `cls`) that a Messages request means."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _text(body.system, "system")
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "system":
            messages.append({"role": "system", "content": _text(blocks, f"messages[{i}].content")})
        else:
            messages += _assistant(blocks, i) if m.role == "assistant" else _user(blocks, i)
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_tokens, "temperature": body.temperature,
        "stop": body.stop_sequences, "stream": body.stream, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if body.top_p is not None:
        chat["top_p"] = body.top_p
    if body.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"], parallel = _tool_choice(body.tool_choice)
        chat["parallel_tool_calls"] = parallel
    return cls.model_validate(chat)


def _user(blocks: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """A user turn: each `tool_result` block a tool message (Anthropic puts them first), then the rest as
    one user message of text and image_url parts."""
    out, parts = [], []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type")
        if kind == "tool_result":
            content = block.get("content") or ""
            if not isinstance(content, str):  # blocks: text joined, images as parts
                content = [_part(p, f"{where}.content") for p in content]
                if all(p["type"] == "text" for p in content):
                    content = "".join(p["text"] for p in content)
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content})
        elif kind in ("text", "image"):
            parts.append(_part(block, where))
        else:
            raise APIError(400, f"{where}: a user message's content block of type {kind!r} is not supported "
                           "(text, image and tool_result are)", param=where)  # fmt: skip
    if parts:
        text_only = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if text_only else parts})
    return out


def _assistant(blocks: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """An assistant turn: its text, and its `tool_use` blocks as `tool_calls`. Thinking blocks are dropped:
    a policy that never wrote them has nothing to continue from them."""
    text, calls = [], []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use":
            if not isinstance(block.get("input"), dict) or not isinstance(block.get("name"), str):
                raise APIError(400, f"{where}: a tool_use block needs a name and an object input", param=where)
            function = {"name": block["name"], "arguments": json.dumps(block["input"])}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(400, f"{where}: an assistant message's content block of type {kind!r} is not supported "
                           "(text, tool_use and thinking are)", param=where)  # fmt: skip
    return [{"role": "assistant", "content": "".join(text)} | ({"tool_calls": calls} if calls else {})]


def _part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A text or base64 image block -> an OpenAI content part (images as data URLs: nothing is fetched)."""
    if block.get("type") == "text":
        return {"type": "text", "text": str(block.get("text", ""))}
    source = block.get("source") or {}
    if block.get("type") == "image" and source.get("type") == "base64":
        return {
            "type": "image_url",
            "image_url": {"url": f"data:{source.get('media_type')};base64,{source.get('data')}"},
        }
    what = f"an image from a {source.get('type')!r} source" if block.get("type") == "image" else repr(block.get("type"))
    raise APIError(400, f"{where}: {what} is not supported here (text, and images as base64)", param=where)


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    """The system prompt's text blocks, one after another (cache_control marks are ignored)."""
    if any(b.get("type") != "text" for b in blocks):
        raise APIError(400, f"{where}: only text blocks are supported", param=where)
    return "\n".join(str(b.get("text", "")) for b in blocks)


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A custom tool -> an OpenAI function tool. Anthropic-defined tools (bash_20250124, web_search_...)
    run on Anthropic's side, which this server is not."""
    if tool.get("type") not in (None, "custom") or "input_schema" not in tool or "name" not in tool:
        raise APIError(
            400, f"tools[{i}]: only custom tools (name, description, input_schema) are supported, got "
            f"{tool.get('type') or 'one without input_schema'!r}", param=f"tools[{i}]",
        )  # fmt: skip
    function = {"name": tool["name"], "description": tool.get("description") or "", "parameters": tool["input_schema"]}
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice -> (chat tool_choice, parallel_tool_calls): `any` forces a call, `tool` a named
    one. `disable_parallel_tool_use` keeps to one call; otherwise the server's default applies."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(
        400, f"tool_choice={choice!r} is not one of auto, any, tool (with a name) or none", param="tool_choice"
    )


# --- answers ---------------------------------------------------------------------------------------------------
def message(completion: dict[str, Any]) -> dict[str, Any]:
    """The chat.completion's first choice as an Anthropic Message."""
    choice = completion["choices"][0]
    m = choice["message"]
    content = ([{"type": "text", "text": m["content"]}] if m.get("content") else []) + [
        _tool_use(c) for c in m.get("tool_calls") or []
    ]
    usage = completion["usage"]
    return {
        "id": _id("msg"), "type": "message", "role": "assistant", "model": completion["model"], "content": content,
        "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"), "stop_sequence": None,
        "usage": _usage(usage["prompt_tokens"], usage["completion_tokens"]),
    }  # fmt: skip


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as a tool_use block; arguments that are not a JSON object (a model wrote a bare
    string) are given as {"input": value}, since Anthropic's `input` is always an object."""
    value = json.loads(call["function"]["arguments"])
    return {
        "type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
        "input": value if isinstance(value, dict) else {"input": value},
    }  # fmt: skip


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens, "output_tokens": completion_tokens,
        "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
    }  # fmt: skip


async def events(chunks: AsyncIterator[dict[str, Any]], model: str, prompt_tokens: int) -> AsyncIterator[dict]:
    """A chat.completion.chunk stream (choice 0, with a last usage chunk) as Anthropic's events: text as it
    comes in one text block, each tool call a tool_use block whose input arrives in one input_json_delta."""
    start = {"id": _id("msg"), "type": "message", "role": "assistant", "model": model, "content": []}
    start |= {"stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_tokens, 0)}
    yield {"type": "message_start", "message": start}
    index, text_open, finish, usage = -1, False, "stop", None
    async for delta, finished, counted in bodies.first_choice(chunks):
        usage, finish = counted or usage, finished or finish
        if delta.get("content"):
            if not text_open:
                index, text_open = index + 1, True
                yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
            yield {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "text_delta", "text": delta["content"]},
            }
        for call in delta.get("tool_calls") or []:
            if text_open:
                yield {"type": "content_block_stop", "index": index}
                text_open = False
            index += 1
            block = _tool_use(call)
            partial = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield {"type": "content_block_start", "index": index, "content_block": block | {"input": {}}}
            yield {"type": "content_block_delta", "index": index, "delta": partial}
            yield {"type": "content_block_stop", "index": index}
    if text_open:
        yield {"type": "content_block_stop", "index": index}
    done = {"output_tokens": usage["completion_tokens"], "input_tokens": usage["prompt_tokens"]} if usage else {}
    delta = {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}
    yield {"type": "message_delta", "delta": delta, "usage": {"output_tokens": 0} | done}
    yield {"type": "message_stop"}


def error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error body: 4xx types by status, any 5xx an api_error."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def new_id() -> str:
    """A Message's id."""
    return _id("msg")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
