"""Tool-call formats per model family: how a model writes its calls, read back into `ParsedCall`s.

A model is trained to call tools in the syntax its own chat template renders: the template writes the
tool calls of earlier assistant turns (`apply_chat_template(messages, tools=...)`), so that is what the
model samples. Each family here gives the parser of that syntax (`parse`), the text a call is written as
(`format_call`, for demonstrations and chat history) and the stop strings that end a call turn. The
family is read off the chat template (`detect_tool_format`); `tool_format=NAME` overrides it.

- `hermes`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2.5/3, Hermes, SmolLM, ours).
- `llama3_json`: the turn is a JSON object `{"name": ..., "parameters": ...}`, after an optional
  `<|python_tag|>` (Llama 3.1-3.3; several calls separated by `;`).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": ...}]` (v3 tokenizers) or, when the template
  writes `[ARGS]` (v11+: Mistral Small 3.2, Magistral, Devstral), `[TOOL_CALLS]name[ARGS]{...}` per call.
- `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`,
  values as text; the tool's JSON schema says which ones are numbers, booleans, arrays or objects.
- `harmony` (gpt-oss): a message on the commentary channel addressed to the tool,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.

Everything malformed is a one-line `ParseError` the model is shown, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from agent_r1.env.tool_calls import (
    CALL_CLOSE,
    ParsedCall,
    ParseError,
    format_tool_call,
    parse_tool_calls,
    tools_system_prompt,
)

ToolFormatName = Literal["auto", "hermes", "llama3_json", "mistral", "mistral_args", "qwen3_coder", "harmony"]
Parsed = list[ParsedCall | ParseError]
Schemas = Mapping[str, dict[str, Any]]  # tool name -> its OpenAI-style schema (`Tool.schema`)


def _json(text: str, prefix: bool = False) -> tuple[Any, str | None]:
    """json.loads (with `prefix`: the JSON value `text` starts with, whatever follows it, an end-of-turn
    token say), or the one-line reason it failed (Python's own limits included)."""
    try:
        return (json.JSONDecoder().raw_decode(text)[0] if prefix else json.loads(text)), None
    except json.JSONDecodeError as exc:
        return None, f"tool call is not valid JSON ({exc.msg} at char {exc.pos})"
    except ValueError:  # a number of more than 4300 digits
        return None, "tool call is not valid JSON (a number has too many digits)"
    except RecursionError:
        return None, "tool call is not valid JSON (nested too deeply)"


# the families' markup that may sit inside a JSON string (it cannot outside one), and the same string
# with its first character escaped: an argument holding it cannot end or start a call early
_ESCAPES = [
    ("</", "<\\/"),
    *((m, "\\u003c" + m[1:]) for m in ("<|", "<parameter=", "<function=")),
    *((m, "\\u005b" + m[1:]) for m in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
]


def _dumps(value: Any) -> str:
    """JSON as the templates write it (`tojson`), with the markup of every family escaped in strings."""
    text = json.dumps(value, ensure_ascii=False)
    for markup, escaped in _ESCAPES:
        text = text.replace(markup, escaped)
    return text


def _call(obj: Any, keys: tuple[str, ...], example: str) -> ParsedCall | ParseError:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParseError(f"tool call must be a JSON object like {example}")
    return ParsedCall(obj["name"], next((obj[k] for k in keys if k in obj), {}))


# -- Llama 3.x JSON --------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
LLAMA_ENDS = ("<|eot_id|>", "<|eom_id|>")
_LLAMA_EXAMPLE = '{"name": "...", "parameters": {...}}'


def parse_llama3_json(text: str, schemas: Schemas | None = None) -> Parsed:
    """A turn that is JSON objects (after an optional `<|python_tag|>`, separated by `;`) is calls; a
    turn that does not start with `{` is an answer. Llama 3 writes `parameters`; `arguments` is read too."""
    body = text.split(PYTHON_TAG, 1)[1] if PYTHON_TAG in text else text
    body = body.strip()
    for end in LLAMA_ENDS:  # the end of the turn, when the engine's text keeps it
        body = body.removesuffix(end).rstrip()
    if not body.startswith("{"):
        return []
    calls: Parsed = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            return [*calls, ParseError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")]
        except (ValueError, RecursionError):
            return [*calls, ParseError("tool call is not valid JSON (too deep, or a number too long)")]
        calls.append(_call(obj, ("parameters", "arguments"), _LLAMA_EXAMPLE))
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
        if pos < len(body) and body[pos] != "{":
            return [*calls, ParseError("text after a tool call: write only the JSON object(s), separated by ';'")]
    return calls


def format_llama3_json(name: str, arguments: Any) -> str:
    return _dumps({"name": name, "parameters": arguments})


# -- Mistral ---------------------------------------------------------------------------------------------

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_EXAMPLE = '[{"name": "...", "arguments": {...}}]'


def parse_mistral(text: str, schemas: Schemas | None = None) -> Parsed:
    """Everything after the first `[TOOL_CALLS]`: a JSON list of calls (v3), or `name[ARGS]{...}` per
    `[TOOL_CALLS]` (v11+, with an optional `[CALL_ID]id` before `[ARGS]`)."""
    if TOOL_CALLS not in text:
        return []
    rest = text.split(TOOL_CALLS, 1)[1]
    if ARGS not in rest or (rest.lstrip().startswith("[") and not rest.lstrip().startswith(ARGS)):
        obj, error = _json(rest.replace(TOOL_CALLS, " ").strip(), prefix=True)
        if error:
            return [ParseError(error)]
        listed = obj if isinstance(obj, list) else [obj]
        return [_call(o, ("arguments", "parameters"), _MISTRAL_EXAMPLE) for o in listed]
    calls: Parsed = []
    for part in rest.split(TOOL_CALLS):
        if ARGS not in part:
            calls.append(ParseError(f"a Mistral tool call is {TOOL_CALLS}name{ARGS}{{...arguments...}}"))
            continue
        name, args = part.split(ARGS, 1)
        name = name.split(CALL_ID, 1)[0].strip()
        obj, error = _json(args.strip(), prefix=True)
        if error or not name:
            calls.append(ParseError(error or f"a Mistral tool call needs a name before {ARGS}"))
        else:
            calls.append(ParsedCall(name, obj))
    return calls


def format_mistral(name: str, arguments: Any) -> str:
    return f"{TOOL_CALLS}[{_dumps({'name': name, 'arguments': arguments})}]"


def format_mistral_args(name: str, arguments: Any) -> str:
    return f"{TOOL_CALLS}{name}{ARGS}{_dumps(arguments)}"


# -- Qwen3-Coder XML -------------------------------------------------------------------------------------

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as its schema's type: strings stay text; numbers, booleans, null, arrays and
    objects are JSON (the template wrote them with `tojson`). Text that does not decode stays text, and
    the tool's argument check reports it."""
    kinds = (schema or {}).get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if not kinds or kinds & {"string", None}:
        return value
    decoded, error = _json(value)
    return value if error else decoded


def parse_qwen3_coder(text: str, schemas: Schemas | None = None) -> Parsed:
    """Every `<function=NAME>` block (inside `<tool_call>` or not), its `<parameter=KEY>` values typed by
    the tool's schema. The template puts one newline around each value; those are taken off."""
    calls: Parsed = []
    for match in _FUNCTION.finditer(text):
        name, body, closed = match.group(1).strip(), match.group(2), match.group(3)
        if not closed:
            calls.append(ParseError("unclosed <function=...> block: end each call with </function>"))
            continue
        schema = (schemas or {}).get(name) or {}
        properties = ((schema.get("function", schema).get("parameters")) or {}).get("properties") or {}
        args = {}
        for p in _PARAMETER.finditer(body):
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[p.group(1).strip()] = _typed(value, properties.get(p.group(1).strip()))
        calls.append(ParsedCall(name, args) if name else ParseError("tool call without a name: <function=NAME>"))
    return calls


def format_qwen3_coder(name: str, arguments: Any) -> str:
    if not isinstance(arguments, dict):
        raise ValueError(f"qwen3_coder tool calls take an object of arguments, got {type(arguments).__name__}")
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else _dumps(v)}\n</parameter>\n" for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n{CALL_CLOSE}"


# -- harmony (gpt-oss) -----------------------------------------------------------------------------------

_HARMONY_MESSAGE = re.compile(r"(.*?)<\|message\|>(.*?)(<\|call\|>|<\|end\|>|<\|return\|>|<\|start\|>|$)", re.DOTALL)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def parse_harmony(text: str, schemas: Schemas | None = None) -> Parsed:
    """Each message whose header names a recipient (`to=functions.NAME`) is a call with its JSON body;
    the analysis and final channels are not."""
    calls: Parsed = []
    for match in _HARMONY_MESSAGE.finditer(text):
        header, body = match.group(1), match.group(2)
        recipient = _RECIPIENT.search(header)
        if recipient is None:
            continue
        name = recipient.group(1).removeprefix("functions.")
        obj, error = _json(body.strip())
        calls.append(ParseError(error) if error else ParsedCall(name, obj))
    return calls


def format_harmony(name: str, arguments: Any) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{_dumps(arguments)}<|call|>"


# -- the families ----------------------------------------------------------------------------------------


Calls = list[tuple[str, Any]]  # (name, arguments) of each call of one turn


def _prose_then_calls(format_call: Callable[[str, Any], str]) -> Callable[[str, Calls], str]:
    def write(content: str, calls: Calls) -> str:
        return "\n".join([content] * bool(content) + [format_call(n, a) for n, a in calls])

    return write


def _llama3_turn(content: str, calls: Calls) -> str:
    """Llama 3 writes a call turn as the call alone: the prose goes."""
    return "; ".join(format_llama3_json(n, a) for n, a in calls)


def _mistral_turn(content: str, calls: Calls) -> str:
    return content + f"{TOOL_CALLS}[" + ", ".join(_dumps({"name": n, "arguments": a}) for n, a in calls) + "]"


def _harmony_turn(content: str, calls: Calls) -> str:
    """The prose as the analysis channel, then each call as a commentary message."""
    thought = f"<|channel|>analysis<|message|>{content}<|end|><|start|>assistant" if content else ""
    return thought + "<|start|>assistant".join(format_harmony(n, a) for n, a in calls)


def _harmony_visible(text: str) -> str:
    """What a client is shown of a harmony turn: its final channel's message (none of the analysis)."""
    if "<|channel|>" not in text:
        return text
    final = text.rsplit("<|channel|>final<|message|>", 1)
    return re.split(r"<\|end\|>|<\|return\|>", final[1], maxsplit=1)[0] if len(final) == 2 else ""


def _opening(any_call: str, named: Callable[[str], str]) -> Callable[[str | None], str]:
    return lambda name: any_call if name is None else named(name)


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax: how to read calls, write them, and show a client the rest."""

    name: str
    parse: Callable[[str, Schemas | None], Parsed]
    format_call: Callable[[str, Any], str]
    write_turn: Callable[[str, Calls], str]  # an assistant turn: its prose, then its calls
    # where a call may begin: the text from there on is not the turn's content (and is not streamed)
    markers: tuple[str, ...]
    # the opening of a call that `tool_choice` forces: any call (None), or one to the named function
    opening: Callable[[str | None], str]
    stop: tuple[str, ...] = ()  # strings that end a call turn (beside the model's EOS)
    visible: Callable[[str], str] = lambda text: text  # the part of a turn a client sees as content


def _hermes(text: str, schemas: Schemas | None = None) -> Parsed:
    return parse_tool_calls(text)


# no trailing space in an opening: BPE tokenizers fold a space into the token after it (` {`), so a
# prompt ending in a bare space is one no model has seen before its arguments
TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat(
            "hermes", _hermes, format_tool_call, _prose_then_calls(format_tool_call), ("<tool_call>",),
            _opening("<tool_call>\n", lambda n: f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments":'),
            stop=(CALL_CLOSE,),
        ),
        ToolFormat(
            "llama3_json", parse_llama3_json, format_llama3_json, _llama3_turn, (PYTHON_TAG, "{"),
            _opening('{"name":', lambda n: f'{{"name": {json.dumps(n)}, "parameters":'),
        ),
        ToolFormat(
            "mistral", parse_mistral, format_mistral, _mistral_turn, (TOOL_CALLS,),
            _opening(f"{TOOL_CALLS}[", lambda n: f'{TOOL_CALLS}[{{"name": {json.dumps(n)}, "arguments":'),
        ),
        ToolFormat(
            "mistral_args", parse_mistral, format_mistral_args,
            lambda content, calls: content + "".join(format_mistral_args(*c) for c in calls), (TOOL_CALLS,),
            _opening(TOOL_CALLS, lambda n: f"{TOOL_CALLS}{n}{ARGS}"),
        ),
        ToolFormat(
            "qwen3_coder", parse_qwen3_coder, format_qwen3_coder, _prose_then_calls(format_qwen3_coder),
            ("<tool_call>", "<function="),
            _opening("<tool_call>\n<function=", lambda n: f"<tool_call>\n<function={n}>\n"), stop=(CALL_CLOSE,),
        ),
        ToolFormat(
            "harmony", parse_harmony, format_harmony, _harmony_turn, ("<|channel|>", "<|start|>"),
            _opening("<|channel|>commentary to=functions.",
                     lambda n: f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"),
            stop=("<|call|>",), visible=_harmony_visible,
        ),
    )
}  # fmt: skip


def detect_tool_format(template: str | None) -> str:
    """The family whose calls a chat template writes, by the syntax in its text; hermes otherwise (and
    for models without a template, which are taught our hermes prompt)."""
    t = template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return "harmony"
    if TOOL_CALLS in t:
        return "mistral_args" if ARGS in t else "mistral"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<|start_header_id|>" in t and "tool_call" in t:
        return "llama3_json"
    return "hermes"


def tool_format(template: str | None, name: str = "auto") -> ToolFormat:
    """`name`, or the template's own family for "auto"; an unknown name is a one-line error."""
    if name == "auto":
        return TOOL_FORMATS[detect_tool_format(template)]
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool_format {name!r}: use auto or one of {', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]


def tools_prompt(schemas: list[dict[str, Any]], instructions: str, fmt: ToolFormat) -> str:
    """Our system prompt listing the tools, for a template that does not render them itself: the call
    syntax it shows is the family's (hermes: the prompt the bundled models are trained with)."""
    example = None if fmt.name == "hermes" else fmt.format_call("tool_name", {"argument": "value"})
    return tools_system_prompt(schemas, instructions, example)
