"""Tool-call formats: parse the calls out of a response, render results back into the context.

Hermes format (Qwen, NousResearch, Agent-R1): every call is a JSON object inside
`<tool_call>...</tool_call>`, several per turn allowed; each result goes back inside
`<tool_response>...</tool_response>`. Everything malformed becomes a `ParseError` that the model is
shown, never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass
class ParsedCall:
    name: str
    arguments: object  # usually a dict; a JSON string is accepted and decoded by the executor


@dataclass
class ParseError:
    message: str  # one line, shown to the model


def parse_tool_calls(text: str) -> list[ParsedCall | ParseError]:
    """Every `<tool_call>` block of a response, in order, parsed or turned into a ParseError."""
    calls: list[ParsedCall | ParseError] = []
    for match in _CALL.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            calls.append(ParseError("unclosed <tool_call> tag: end each call with </tool_call>"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ParseError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})"))
            continue
        except ValueError:  # a number of more than 4300 digits, which Python will not turn into an int
            calls.append(ParseError("tool call is not valid JSON (a number has too many digits)"))
            continue
        except RecursionError:
            calls.append(ParseError("tool call is not valid JSON (nested too deeply)"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ParseError('tool call must be a JSON object like {"name": "...", "arguments": {...}}'))
            continue
        calls.append(ParsedCall(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    return calls


def format_tool_call(name: str, arguments: object) -> str:
    """One call exactly as the model is taught to write it (demonstrations, chat history, the server).

    `</` only occurs inside JSON strings; it is written `<\\/` (the same string to JSON), so a
    `</tool_call>` in an argument cannot end the call early."""
    payload = json.dumps({"name": name, "arguments": arguments}).replace("</", "<\\/")
    return f"{CALL_OPEN}\n{payload}\n{CALL_CLOSE}"


def extract_answer(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` tag, or None when there is none."""
    # Searching only up to the last closing tag keeps this linear: every `<answer>` left then has a
    # closing after it, whereas each unclosed one would rescan the rest of the text.
    end = text.rfind("</answer>")
    found = _ANSWER.findall(text, 0, end + len("</answer>")) if end >= 0 else []
    return found[-1].strip() if found else None


def format_tool_responses(outputs: list[str], images: list[list[Any]] | None = None) -> str | list[dict[str, Any]]:
    """One user turn holding every result of this step, in call order (as Qwen's template does). With
    `images` (per output, what the tool returned), content parts: each image inside its response."""
    if not images or not any(images):
        return "\n".join(f"<tool_response>\n{out}\n</tool_response>" for out in outputs)
    parts: list[dict[str, Any]] = []
    for i, (out, shown) in enumerate(zip(outputs, images, strict=True)):
        parts.append({"type": "text", "text": ("\n" if i else "") + f"<tool_response>\n{out}"})
        for image in shown:
            parts += [{"type": "text", "text": "\n"}, {"type": "image", "image": image}]
        parts.append({"type": "text", "text": "\n</tool_response>"})
    return parts


def tools_system_prompt(schemas: list[dict], instructions: str = "", example: str | None = None) -> str:
    """Hermes-style system prompt: the tool schemas and the exact call syntax (`example`: a call in
    another family's syntax, for a model whose template does not render tools itself)."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    syntax = (
        "To call a tool, write a JSON object inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <tool-name>, "arguments": <arguments-object>}\n</tool_call>\n'
        if example is None
        else f"To call a tool, write the call exactly as in this example:\n{example}\n"
    )
    return (
        (instructions.strip() + "\n\n" if instructions.strip() else "")
        + "You can call tools. Their signatures are inside <tools></tools>:\n<tools>\n"
        + listed
        + "\n</tools>\n"
        + syntax
        + "Each result comes back inside <tool_response></tool_response> tags."
    )
