"""OpenAI chat requests <-> the tool-calling format `ToolEnv` trains with (the model family's syntax,
agent_r1.env.tool_formats): shared by `agent-r1 serve` and the gateway (agent_r1/gateway), so a request is
rendered, and an answer turned into `tool_calls`, the same way in both.

* `template_messages`: OpenAI messages (system, user, assistant with `tool_calls`, tool results) -> the
  messages `ToolEnv` would have built: for a template that renders tools itself, the messages as they
  are; otherwise one system prompt listing the tools, calls in the family's syntax (hermes `<tool_call>`
  blocks for the bundled models), consecutive tool results as one user turn of `<tool_response>` blocks.
* `chat_result`: one sampled response -> (content, OpenAI `tool_calls`, finish_reason).
* `tool_schemas`, `check_unicode`: the request's tools and strings checked, a 400 naming the first bad one.
* `forced_call`: what a forcing `tool_choice` (`required`, a named function) fixes of the answer's start;
  `answer_grammar`: the grammar the rest of the answer is sampled under (the forced call's arguments, or
  `response_format`'s JSON), so that the structure the API promises is guaranteed (models/grammar.py).
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any

import jsonschema

from agent_r1.api.schema import APIError, ChatMessage, ToolSpec
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import ParsedCall, format_tool_responses
from agent_r1.env.tool_formats import TOOL_FORMATS, ToolFormat, tools_prompt
from agent_r1.models.grammar import concat, json_schema_grammar, literal, union
from agent_r1.rollout.text_stream import visible_prefix
from agent_r1.tools import Tool
from agent_r1.types import Message


def template_messages(messages: list[ChatMessage], tools: list[dict], fmt: PromptFormat | None = None) -> list[Message]:
    """OpenAI messages -> the messages `ToolEnv` would have built for the model's prompt format `fmt`
    (hermes without one). A template that renders tools itself gets them as OpenAI gives them (calls as
    `tool_calls`, results as "tool" messages; the tools go in through `fmt.with_tools`). Otherwise: one
    system prompt listing the tools, calls written in the model's family syntax (hermes `<tool_call>`
    blocks for the bundled models), and consecutive tool results as one user turn."""
    if fmt is not None and fmt.native_tools and not any(message_images(m) for m in messages if m.role == "tool"):
        return _structured(messages)
    calls_format = fmt.tool_format if fmt is not None else TOOL_FORMATS["hermes"]
    out: list[Message] = []
    system: list[str] = []
    results: list[str] = []
    shown: list[list[str]] = []  # per tool result, its images
    for i, m in enumerate(messages):
        if results and m.role != "tool":
            out.append({"role": "user", "content": format_tool_responses(results, shown)})
            results, shown = [], []
        text = message_text(m, i, images=m.role in ("user", "tool"))
        if m.role == "tool":
            results.append(text)
            shown.append(message_images(m))
        elif m.role in ("system", "developer") and tools:
            system.append(text)  # becomes the instructions of the tools system prompt
        elif m.role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        elif m.role == "assistant":
            calls = [(c.function.name, _arguments(c.function.arguments, i)) for c in m.tool_calls or []]
            out.append({"role": "assistant", "content": calls_format.write_turn(text, calls) if calls else text})
        else:
            out.append(_user_message(m, text))
    if results:
        out.append({"role": "user", "content": format_tool_responses(results, shown)})
    if tools:
        out.insert(0, {"role": "system", "content": tools_prompt(tools, "\n\n".join(system), calls_format)})
    return out


def _structured(messages: list[ChatMessage]) -> list[Message]:
    """OpenAI messages for a template that renders tool calls and results itself: calls with decoded
    arguments, and each result named by the call it answers (gpt-oss's template addresses it so)."""
    out: list[Message] = []
    names: dict[str | None, str] = {}  # tool_call_id -> the function it called
    for i, m in enumerate(messages):
        text = message_text(m, i, images=m.role == "user")
        if m.role == "assistant":
            calls = []
            for c in m.tool_calls or []:
                names[c.id] = c.function.name
                function = {"name": c.function.name, "arguments": _arguments(c.function.arguments, i)}
                calls.append({"type": "function", "id": c.id, "function": function})
            out.append({"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {}))
        elif m.role == "tool":
            name = names.get(m.tool_call_id)
            out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id, "name": name})
        elif m.role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        else:
            out.append(_user_message(m, text))
    return out


def _user_message(m: ChatMessage, text: str) -> Message:
    """A user turn: its image_url parts as images before its text."""
    images = [{"type": "image", "image": url} for url in message_images(m)]
    return {"role": "user", "content": [*images, {"type": "text", "text": text}] if images else text}


def message_text(m: ChatMessage, i: int, images: bool = False) -> str:
    """The text of a message; `images`: its image_url parts are allowed (user and tool messages), and
    each must be a data URL (a server that fetched URLs would reach wherever a client points it)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    allowed = ("text", "image_url") if images else ("text",)
    if any(part.get("type") not in allowed for part in m.content):
        what = "text and image_url" if images else "text"
        raise APIError(400, f"only {what} content parts are supported here", param=f"messages[{i}].content")
    if any(not str(url).startswith("data:") for url in message_images(m)):
        raise APIError(400, "an image_url must be a data: URL (base64)", param=f"messages[{i}].content")
    return "".join(str(part.get("text", "")) for part in m.content if part.get("type") == "text")


def message_images(m: ChatMessage) -> list[str]:
    """The image URLs of a message's image_url parts, in order (images go before its text)."""
    if not isinstance(m.content, list):
        return []
    return [str(url.get("url") if isinstance(url, dict) else url) for p in m.content if (url := p.get("image_url"))]


def _arguments(arguments: str, i: int) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, a number of more than 4300 digits, nesting too deep
        raise APIError(400, "tool call arguments must be a JSON string", param=f"messages[{i}].tool_calls") from None


def tool_schemas(specs: list[ToolSpec]) -> list[dict]:
    """Validate client tools like our own: a valid name and an object JSON schema (they run client-side).
    Agents send the same tools with every request, and checking a schema costs milliseconds of CPU: a list
    that passed is remembered by its JSON."""
    return json.loads(_checked_tools(json.dumps([spec.model_dump() for spec in specs])))


@functools.lru_cache(maxsize=256)
def _checked_tools(specs_json: str) -> str:
    schemas = []
    for i, spec in enumerate(json.loads(specs_json)):
        f = ToolSpec.model_validate(spec).function
        try:
            if f.parameters.get("type") != "object":
                raise ValueError('parameters must be a JSON schema with "type": "object"')
            schemas.append(Tool(f.name, f.description, f.parameters, fn=_runs_on_client).schema)
        except (ValueError, TypeError, jsonschema.SchemaError) as exc:  # TypeError: `$schema` is not a string
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise APIError(400, f"invalid tool {f.name!r}: {message}", param=f"tools[{i}]") from None
    return json.dumps(schemas)


def forced_call(tool_choice: Any, tools: list[dict], calls: ToolFormat = TOOL_FORMATS["hermes"]) -> str:
    """The start of the answer that `tool_choice` fixes, "" when it forces nothing.

    "required" opens a call (hermes: `<tool_call>` and its newline); a named function opens a call to that
    function up to its arguments, as the family `calls` writes one (`ToolFormat.opening`). The prefix goes
    into the prompt, written by the environment, and the policy samples on from it: nothing it did not
    sample is trained as sampled, and the call it finishes is the one OpenAI's API promises. (vLLM forces
    the same with a JSON-schema grammar; a prefix needs no constrained decoding and works with every
    engine, at the price of the arguments being free-form: a malformed call stays content, as with
    "auto".)"""
    if tool_choice in (None, "auto", "none"):
        return ""
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
    if tool_choice != "required" and not isinstance(name, str):
        raise APIError(
            400, f"tool_choice={tool_choice!r} is not one of 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}', param="tool_choice",
        )  # fmt: skip
    if not tools:
        message = f"tool_choice={tool_choice!r} forces a tool call, but the request lists no tools"
        raise APIError(400, message, param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name is not None and name not in names:
        message = f"tool_choice names the function {name!r}, which is not among the request's tools {names}"
        raise APIError(400, message, param="tool_choice")
    return calls.opening(name)


def answer_grammar(
    body: Any, tools: list[dict], calls: ToolFormat = TOOL_FORMATS["hermes"], special: tuple[str, ...] = ()
) -> str | None:
    """The grammar the sampled answer must match, None when the request promises no structure: after a forced
    call's opening (`forced_call`, in the prompt), the rest of the call, its arguments valid against the
    function's schema; else the JSON that `response_format` asks for. `special`: the tokenizer's special
    tokens, which a grammar cannot write as text (a family whose call syntax needs one after the opening,
    harmony or Qwen3-Coder's XML, gets the opening alone, as before)."""
    opening = forced_call(body.tool_choice, tools, calls)
    if opening:
        return _call_grammar(body.tool_choice, tools, calls, opening, special)
    response_format = body.response_format or {"type": "text"}
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(None)
    schema = (response_format.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if kind != "json_schema" or not isinstance(schema, dict):
        message = "response_format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
        raise APIError(400, message + "'json_schema': {'name': ..., 'schema': {...}}}", param="response_format")
    try:
        return json_schema_grammar(schema)
    except ValueError as exc:
        raise APIError(400, f"response_format.json_schema.schema: {exc}", param="response_format") from None


_ARGUMENTS = "@agent_r1_arguments@"  # stands for a call's arguments while a call is written out around them


def _call_grammar(
    tool_choice: Any, tools: list[dict], calls: ToolFormat, opening: str, special: tuple[str, ...]
) -> str | None:
    """The rest of a forced call after `opening`: each allowed function's call as the family writes it, with
    JSON valid against its parameters where the arguments go; None for a family that does not write
    arguments as one JSON value, or whose rest of a call holds a special token."""
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    choices = []
    for tool in tools:
        f = tool["function"]
        if name is not None and f["name"] != name:
            continue
        try:
            text = calls.format_call(f["name"], _ARGUMENTS)
        except (AttributeError, TypeError, ValueError):  # a family that writes arguments key by key
            return None
        marker = json.dumps(_ARGUMENTS)
        if text.count(marker) != 1 or not text.startswith(opening):
            return None
        head, tail = text[len(opening) :].split(marker)
        if any(token in head + tail for token in special):
            return None
        choices.append(concat(literal(head), json_schema_grammar(f["parameters"]), literal(tail)))
    return union(*choices)


def _runs_on_client(**_: Any) -> None:
    raise RuntimeError("tools given in a request are called by the client, never by the server")


def chat_result(
    text: str, stops: tuple[str, ...], tools: list[dict], finish: str, calls_format: ToolFormat = TOOL_FORMATS["hermes"]
) -> tuple[str | None, list, str]:
    """(content, OpenAI tool_calls, finish_reason) of one response, read in the model's family syntax
    (the request's `tools` type Qwen3-Coder's text values). A malformed call stays content, as vLLM's parsers
    leave it: the program can show the model its error, and a framework given no content and no call fails
    the episode. (A forced call is sampled under a grammar, so it always parses: `answer_grammar`.)"""
    schemas = {t["function"]["name"]: t for t in tools}
    calls = [c for c in calls_format.parse(text, schemas) if isinstance(c, ParsedCall)] if tools else []
    shown = calls_format.visible(text)
    if not calls:
        return visible_prefix(shown, stops, final=True), [], "length" if finish == "length" else "stop"
    openai_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c.name,
                "arguments": _json_text(c.arguments),
            },
        }
        for c in calls
    ]
    content = visible_prefix(shown, (*calls_format.markers, *stops), final=True)
    return (content if content.strip() else None), openai_calls, "tool_calls"


def _json_text(arguments: object) -> str:
    """A call's arguments as OpenAI's `arguments`, always JSON text: a string the model wrote that is JSON goes
    as it is (decoded by the client, as ToolEnv's executor decodes it); any other string (`"6 * 7"`) goes as a
    JSON string, so a client that sends the call back in its history is not refused for it (a 400)."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            return arguments
        except (ValueError, RecursionError):
            return json.dumps(arguments)
    return json.dumps(arguments)


def check_unicode(body: Any) -> None:
    """A 400 naming the first string that is not Unicode text: JSON's `\\ud800` escape gives a lone
    surrogate, which the tokenizer refuses with a TypeError (a 500) and UTF-8 cannot encode."""
    stack: list[tuple[str, Any]] = [("", body.model_dump())]
    while stack:  # iterative: content parts may nest deeper than the recursion limit
        path, value = stack.pop()
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise APIError(
                    400, f"{path}: text is not valid Unicode (a lone surrogate at character {exc.start})", param=path
                ) from None
        elif isinstance(value, dict):
            stack += [(f"{path}.{k}".lstrip("."), v) for k, v in value.items()]
            stack += [(path, k) for k in value if isinstance(k, str)]  # keys reach the prompt too (tool schemas)
        elif isinstance(value, list):
            stack += [(f"{path}.{i}", v) for i, v in enumerate(value) if isinstance(v, str | dict | list)]
