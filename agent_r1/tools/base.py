"""Tools: a typed Python function whose docstring becomes its JSON schema, and a safe way to call it.

The extension contract is deliberately tiny (as in verifiers and TRL's `tools=`): write a function
with type hints and a Google-style docstring, decorate it with `@tool`, done. The schema the model
sees is generated from that function, so it can never drift from the code.

`execute_tool_call` is the only way the framework runs a tool. During RL the model emits garbage
all the time: unknown names, arguments as strings, wrong types, calls that raise, hang or print
megabytes. None of that may crash a run. Every failure becomes a short, one-line observation the
model sees (so it can learn from it) plus an `error` kind the trainer counts as a metric.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import jsonschema
from transformers.utils import get_json_schema

# Sync tools run here, not in asyncio's default executor: `asyncio.run` joins the default executor
# at shutdown, so one hung tool would hang the whole program. Python cannot kill a thread; a timed
# out tool keeps its worker until it returns, which is why the pool is generous.
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="agent-r1-tool")

_MAX_ERROR_CHARS = 300  # dynamic parts of error messages (exception text, names) are cut to this
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-style APIs accept as a function name

ERROR_KINDS = ("unknown_tool", "invalid_arguments", "exception", "timeout")


@dataclass
class ToolResult:
    """What a tool may return instead of a plain value: a per-call (process) reward, or a failure the
    tool handled itself (the model still reads `output`; the trainer counts `error` by kind)."""

    output: str
    reward: float | None = None
    error: str | None = None  # a short kind such as "timeout" or "memory_limit"; None on success
    images: list[Any] = field(default_factory=list)  # shown after `output`: PIL images, arrays, paths, data URLs


@dataclass
class Tool:
    """A callable the model can invoke by name, with the JSON schema of its arguments.

    Usually built by `@tool`; build it directly to wrap a function whose schema you write by hand.
    """

    name: str
    description: str
    parameters: dict[str, Any]  # OpenAI-style object schema: {"type": "object", "properties": ...}
    fn: Callable[..., Any]  # sync or async; returns a value (shown as str(value)) or a ToolResult
    timeout: float = 10.0  # seconds before the call is abandoned and reported as a timeout
    max_output_chars: int = 4000  # longer outputs are cut, so one call cannot flood the context
    close: Callable[[], Awaitable[None]] | None = None  # frees a per-episode resource (ToolEnv.close)
    _validator: jsonschema.protocols.Validator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not TOOL_NAME_RE.match(self.name):
            raise ValueError(f"tool name {self.name!r} must match {TOOL_NAME_RE.pattern}")
        if self.timeout <= 0 or self.max_output_chars <= 0:
            raise ValueError(f"tool {self.name}: timeout and max_output_chars must be positive")
        # Built once here so a broken schema fails when the tool is defined, not mid-rollout.
        self._validator = _make_validator(self.parameters)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema, as passed to a chat template's `tools=`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying function directly, so a decorated function stays usable as one."""
        return self.fn(*args, **kwargs)


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float = 10.0,
    max_output_chars: int = 4000,
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float = 10.0,
    max_output_chars: int = 4000,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function with a Google-style docstring into a `Tool`.

    Use bare (`@tool`) or with options (`@tool(timeout=2.0)`). The description is the docstring's
    text before `Args:`; each argument's description comes from its `Args:` entry.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        function = _schema_from_function(f)
        return Tool(
            name=name or function["name"],
            description=description if description is not None else function["description"],
            parameters=function["parameters"],
            fn=f,
            timeout=timeout,
            max_output_chars=max_output_chars,
        )

    return wrap(fn) if fn is not None else wrap


def _schema_from_function(fn: Callable[..., Any]) -> dict[str, Any]:
    """The "function" part of the schema transformers builds from hints + docstring, minus "return"."""
    fn_name = getattr(fn, "__name__", repr(fn))
    try:
        function = get_json_schema(fn)["function"]
    except Exception as e:  # transformers raises its own parsing exceptions; re-raise them as one kind
        raise TypeError(f"@tool cannot build a schema for {fn_name}: {_one_line(str(e))}") from e
    function.pop("return", None)  # models only need the arguments; return schemas confuse templates
    return function


def _make_validator(parameters: dict[str, Any]) -> jsonschema.protocols.Validator:
    """A validator that also rejects unknown argument names and honours OpenAPI's `nullable`."""
    schema = _strict(parameters)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def _strict(schema: Any) -> Any:
    """Copy of `schema` with `additionalProperties: false` on objects with properties and
    `nullable: true` (emitted by transformers for `X | None`) turned into JSON Schema's `null` type.

    A model passing an argument the function does not take is a mistake it should be told about,
    not a silent `TypeError` from Python.
    """
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", False)
    if out.pop("nullable", False) and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"] if "null" not in types else types
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    return out


@dataclass
class ToolCallResult:
    """The outcome of one tool call: what the model will see, and what the trainer counts."""

    name: str
    arguments: dict[str, Any]  # parsed arguments ({} when they could not be parsed)
    output: str  # exactly what the model will see, error messages included
    error: str | None = None  # None on success, else one of ERROR_KINDS or the kind a ToolResult gave
    truncated: bool = False  # output was cut to the tool's max_output_chars
    reward: float | None = None  # process reward from a ToolResult, None if the tool gave none
    seconds: float = 0.0  # wall time of the whole call
    images: list[Any] = field(default_factory=list)  # images the tool returned (read by the env's format)


async def execute_tool_call(tools: Mapping[str, Tool], name: str, arguments: object) -> ToolCallResult:
    """Run one tool call the model asked for. Never raises for anything the model or the tool does.

    `arguments` may be a dict or a JSON string of a dict, because some models emit the latter.
    """
    start = time.perf_counter()

    def fail(kind: str, message: str, args: dict[str, Any] | None = None) -> ToolCallResult:
        return ToolCallResult(
            name=_safe_str(name),
            arguments=args or {},
            output=f"Error: {message}",
            error=kind,
            seconds=time.perf_counter() - start,
        )

    t = tools.get(name) if isinstance(name, str) else None
    if t is None:
        available = ", ".join(sorted(tools)) or "none"
        return fail("unknown_tool", f"unknown tool {_cut(_safe_str(name))!r}. Available tools: {available}.")

    args, problem = _parse_arguments(t, arguments)
    if problem is not None:
        return fail("invalid_arguments", f"invalid arguments for {t.name}: {problem}", args)

    try:
        value, exc = await asyncio.wait_for(_invoke(t.fn, args), timeout=t.timeout)
    except TimeoutError:
        return fail("timeout", f"tool {t.name} timed out after {t.timeout:g}s", args)
    if exc is not None:
        return fail("exception", f"{t.name} raised {_cut(f'{type(exc).__name__}: {_safe_str(exc)}')}", args)

    reward = error = None
    images: list[Any] = []
    if isinstance(value, ToolResult):
        value, reward, error, images = value.output, value.reward, value.error, list(value.images)
    try:
        text = str(value)
    except Exception as e:  # a broken __str__, an int of more than 4300 digits
        problem = _cut(f"{type(value).__name__} that str() cannot show ({type(e).__name__}: {_safe_str(e)})")
        return fail("exception", f"{t.name} returned a {problem}", args)
    output, truncated = _truncate(text, t.max_output_chars)
    return ToolCallResult(
        name=t.name,
        arguments=args,
        output=output,
        error=error,
        truncated=truncated,
        reward=reward,
        seconds=time.perf_counter() - start,
        images=images,
    )


def _parse_arguments(t: Tool, arguments: object) -> tuple[dict[str, Any], str | None]:
    """(arguments as a dict, None) if they are valid for `t`, else ({} or the dict, a one-line problem)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return {}, f"arguments are not valid JSON ({e.msg} at position {e.pos})"
        except ValueError:  # a number of more than 4300 digits, which Python will not turn into an int
            return {}, "arguments are not valid JSON (a number has too many digits)"
        except RecursionError:
            return {}, "arguments are not valid JSON (nested too deeply)"
    if not isinstance(arguments, dict):
        return {}, f"arguments must be a JSON object, got {type(arguments).__name__}"
    try:
        error = jsonschema.exceptions.best_match(t._validator.iter_errors(arguments))
    except Exception as e:  # jsonschema puts repr(value) in its messages, and some values cannot give one
        return arguments, _cut(f"arguments cannot be checked against the schema ({type(e).__name__}: {_safe_str(e)})")
    if error is None:
        return arguments, None
    where = "/".join(str(p) for p in error.absolute_path)
    return arguments, _cut(f"{where}: {error.message}" if where else error.message)


async def _invoke(fn: Callable[..., Any], args: dict[str, Any]) -> tuple[Any, Exception | None]:
    """Call `fn` and return (value, None) or (None, exception).

    Exceptions are returned, not raised, so a tool that itself raises `TimeoutError` (say, from a
    network call) is reported as an exception, and only our own deadline counts as a timeout.
    """
    try:
        if inspect.iscoroutinefunction(fn):
            value = await fn(**args)
        else:
            loop = asyncio.get_running_loop()
            # The exception comes back as a value: a StopIteration cannot be set on an asyncio future (the
            # call would never finish and be reported as a timeout).
            value, exc = await loop.run_in_executor(_EXECUTOR, _call, fn, args)
            if exc is not None:
                return None, exc
        if inspect.isawaitable(value):  # a sync callable that hands back a coroutine
            value = await value
        return value, None
    except Exception as e:
        return None, e


def _call(fn: Callable[..., Any], args: dict[str, Any]) -> tuple[Any, Exception | None]:
    """`fn(**args)` in a worker thread, as (value, None) or (None, exception)."""
    try:
        return fn(**args), None
    except Exception as e:
        return None, e


def _truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """Cut `text` to `max_chars`, with a marker saying how much was dropped so the model knows."""
    if len(text) <= max_chars:
        return text, False
    return f"{text[:max_chars]}\n...[truncated {len(text) - max_chars} chars]", True


def _safe_str(obj: object) -> str:
    """`str(obj)`, or a placeholder when that raises (a broken `__str__`, an int of more than 4300 digits)."""
    try:
        return str(obj)
    except Exception as e:
        return f"<str() failed: {type(e).__name__}>"


def _one_line(text: str) -> str:
    """Collapse whitespace (newlines included), so error observations stay one line."""
    return " ".join(text.split())


def _cut(text: str, max_chars: int = _MAX_ERROR_CHARS) -> str:
    """One line of at most about `max_chars` chars: error messages must stay short."""
    text = _one_line(text)
    return text if len(text) <= max_chars else text[:max_chars] + "..."
