"""OpenAI's Responses API (https://platform.openai.com/docs/api-reference/responses) as a face of the one chat
pipeline, for agents that speak it (Codex CLI, the Agents SDK's default model):

* `to_chat`: a Responses request (its `input` items after the stored conversation of `previous_response_id`,
  `instructions` as the system message) -> the chat request it means: message items -> messages,
  `function_call` items -> an assistant turn's `tool_calls`, `function_call_output` -> tool messages;
* `response`: the chat.completion the server answers -> a Response with its output items (a message of
  `output_text`, then a `function_call` item per call);
* `events`: a chat.completion.chunk stream -> the Responses stream (response.created ... response.completed),
  with item ids that agree from `output_item.added` to the final response, as the `openai` SDK checks;
* `ResponseStore`: what `previous_response_id` refers to, kept per episode (gateway) or per server.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from agent_r1.api import bodies
from agent_r1.api.schema import APIError, ChatCompletionRequest

Chat = TypeVar("Chat", bound=ChatCompletionRequest)
TEXT_PARTS = ("input_text", "output_text", "text")  # content parts whose text reaches the prompt


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Unknown fields (reasoning, include, truncation, user) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | "json_object", ...}}
    metadata: dict[str, Any] | None = None


class ResponseStore:
    """Each stored response's whole conversation as items (the inputs before it, its own input, its output),
    so `previous_response_id` continues it. Bounded: the oldest are forgotten past `capacity`."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def history(self, response_id: str | None) -> list[dict[str, Any]]:
        """The conversation up to and including `response_id`; a 404 naming an id this store does not hold."""
        if response_id is None:
            return []
        if response_id not in self._items:
            raise APIError(
                404, f"previous_response_id {response_id!r} is not a stored response here (responses are kept per "
                "episode, with store=true)", param="previous_response_id", code="previous_response_not_found",
            )  # fmt: skip
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def put(self, response_id: str, items: list[dict[str, Any]]) -> None:
        self._items[response_id] = items
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    return [{"role": "user", "content": body.input}] if isinstance(body.input, str) else list(body.input)


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]], cls: type[Chat], model: str) -> Chat:
    """The chat request (of the server's class `cls`) that `history` + the request's input items mean;
    `instructions` are this request's system message (they are not carried over from earlier responses)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    for i, item in enumerate([*history, *input_items(body)]):
        where = f"input[{i - len(history)}]" if i >= len(history) else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant":  # calls after the turn's text, or after each other: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else _parts(output, where)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind != "reasoning":  # the policy writes no reasoning items: nothing to continue from
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output are)", param=where)  # fmt: skip
    chat: dict[str, Any] = {
        "model": body.model or model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
        "stream_options": {"include_usage": True}, "parallel_tool_calls": body.parallel_tool_calls,
    }  # fmt: skip
    if body.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        named = isinstance(choice, dict) and choice.get("type") == "function"
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} if named else choice
    fmt = (body.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":  # Responses flattens what chat nests under "json_schema"
        chat["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    elif fmt:
        chat["response_format"] = fmt
    return cls.model_validate(chat)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise APIError(400, f"{where}.role: {role!r} is not user, system, developer or assistant", param=where)
    content = item.get("content", "")
    return {"role": role, "content": content if isinstance(content, str) else _parts(content, where)}


def _parts(parts: list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    """Responses content parts -> OpenAI chat parts (text, and images as data URLs); text alone as a string."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind in TEXT_PARTS or kind == "refusal":
            out.append({"type": "text", "text": str(part.get("text", part.get("refusal", "")))})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise APIError(400, f"{where}.content[{j}]: a content part of type {kind!r} is not supported "
                           "(input_text, output_text and input_image with an image_url are)", param=where)  # fmt: skip
    return "".join(p["text"] for p in out) if all(p["type"] == "text" for p in out) else out


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat: name, description, parameters) -> a chat function tool."""
    if tool.get("type") != "function" or "name" not in tool:
        raise APIError(400, f"tools[{i}]: only function tools are supported here, got {tool.get('type')!r} "
                       "(built-in tools such as web_search run on OpenAI's side)", param=f"tools[{i}]")  # fmt: skip
    function = {"name": tool["name"], "description": tool.get("description") or ""}
    return {"type": "function", "function": function | {"parameters": tool.get("parameters") or {"type": "object"}}}


# --- answers ---------------------------------------------------------------------------------------------------
def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer as Responses output items: its text as a message, each tool call a function_call."""
    items = [_text_item(message["content"])] if message.get("content") else []
    return items + [_call_item(c) for c in message.get("tool_calls") or []]


def _text_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant", "content": [part]}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    f = call["function"]
    return {
        "type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": f["name"],
        "arguments": f["arguments"], "status": "completed",
    }  # fmt: skip


def response(
    body: ResponsesRequest, response_id: str, model: str, output: list[dict[str, Any]], finish: str | None,
    usage: dict[str, int] | None,
) -> dict[str, Any]:  # fmt: skip
    """The Response object: `incomplete` when the answer ran out of `max_output_tokens`, `in_progress` while
    streaming (finish None)."""
    status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": bool(body.parallel_tool_calls), "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
        "store": body.store, "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
        "metadata": body.metadata or {}, "usage": _usage(usage) if usage else None,
    }  # fmt: skip


def from_completion(body: ResponsesRequest, response_id: str, completion: dict[str, Any]) -> dict[str, Any]:
    """A whole chat.completion as a Response."""
    choice = completion["choices"][0]
    output = output_items(choice["message"])
    return response(body, response_id, completion["model"], output, choice["finish_reason"], completion["usage"])


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip


async def events(
    chunks: AsyncIterator[dict[str, Any]], body: ResponsesRequest, response_id: str, model: str,
    done: Callable[[list[dict[str, Any]]], None] = lambda _: None,
) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    """A chat.completion.chunk stream (choice 0, a last usage chunk) as the Responses stream; `done(output)`
    is called with the output items once the answer is whole (to store it)."""
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1} | fields

    output: list[dict[str, Any]] = []
    text: dict[str, Any] | None = None  # the message item being written
    yield event("response.created", response=response(body, response_id, model, [], None, None))
    yield event("response.in_progress", response=response(body, response_id, model, [], None, None))
    finish, usage = "stop", None
    async for delta, finished, counted in bodies.first_choice(chunks):
        usage, finish = counted or usage, finished or finish
        if delta.get("content"):
            if text is None:
                text = _text_item("", "in_progress")
                output.append(text)
                where = {"item_id": text["id"], "output_index": len(output) - 1}
                yield event("response.output_item.added", output_index=len(output) - 1, item=text | {"content": []})
                yield event("response.content_part.added", **where, content_index=0, part=dict(text["content"][0]))
            text["content"][0]["text"] += delta["content"]
            yield event("response.output_text.delta", **where, content_index=0, delta=delta["content"], logprobs=[])
        for call in delta.get("tool_calls") or []:
            if text is not None and text["status"] == "in_progress":
                for e in _close_text(event, text, where):
                    yield e
            item = _call_item(call)
            output.append(item)
            at = {"item_id": item["id"], "output_index": len(output) - 1}
            added = item | {"arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=at["output_index"], item=added)
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"])
            yield event("response.output_item.done", output_index=at["output_index"], item=item)
    if text is not None and text["status"] == "in_progress":
        for e in _close_text(event, text, where):
            yield e
    done(output)
    final = response(body, response_id, model, output, finish, usage)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


def _close_text(event: Callable[..., dict], text: dict[str, Any], where: dict[str, Any]) -> list[dict[str, Any]]:
    """The events that end the message item: its text, its part and the item, done."""
    text["status"] = "completed"
    part = text["content"][0]
    return [
        event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
        event("response.content_part.done", **where, content_index=0, part=dict(part)),
        event("response.output_item.done", output_index=where["output_index"], item=text | {"content": [dict(part)]}),
    ]


def error_event(err: APIError) -> dict[str, Any]:
    """A failure mid-stream, as the Responses stream reports it."""
    return {"type": "error", "code": err.code, "message": err.message, "param": err.param, "sequence_number": 0}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def new_id() -> str:
    return _id("resp")
