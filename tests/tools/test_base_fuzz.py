"""Fuzzing `execute_tool_call`: no name, no arguments and no tool behaviour makes it raise.

A failure becomes an `error` kind the trainer counts and a one-line "Error: ..." the model reads; a success
is the tool's output, cut to `max_output_chars` plus a marker saying how much was dropped.
"""

from __future__ import annotations

import asyncio
import decimal
import json
from typing import Any, Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.tools import Tool, ToolResult, execute_tool_call, tool
from agent_r1.tools.base import ERROR_KINDS
from tests.conftest import examples

TIMEOUT = 5.0  # no fuzzed tool sleeps, so a "timeout" result is always a bug
MAX_ERROR_CHARS = 1000  # error observations stay short whatever the tool raised (names, messages are cut)


def typed(
    count: int,
    ratio: float,
    mode: Literal["add", "mul"],
    flag: bool = False,
    note: str | None = None,
    items: list[int] | None = None,
    grid: list[list[float]] | None = None,
    table: dict[str, int] | None = None,
) -> str:
    """Echo the arguments as JSON: ints, floats, an enum, optionals and nested containers.

    Args:
        count: An integer.
        ratio: A number.
        mode: One of two words.
        flag: A boolean.
        note: An optional string.
        items: Optional integers.
        grid: Optional rows of numbers.
        table: Optional names to integers.
    """
    return json.dumps(
        dict(count=count, ratio=ratio, mode=mode, flag=flag, note=note, items=items, grid=grid, table=table)
    )


async def now() -> str:
    """An async tool without arguments."""
    return "12:00"


NESTED = {
    "type": "object",
    "properties": {
        "spec": {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0}}, "required": ["k"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["spec"],
}
TOOLS = {
    t.name: t
    for t in (
        tool(typed, timeout=TIMEOUT),
        tool(now, timeout=TIMEOUT),
        Tool("nested", "A hand-written nested schema.", NESTED, fn=lambda **kw: kw, timeout=TIMEOUT),
        # no "properties": any object is valid, even one whose keys Python cannot pass as keywords
        Tool("anything", "Takes any object.", {"type": "object"}, fn=lambda **kw: sorted(kw), timeout=TIMEOUT),
    )
}


class Unprintable:
    """A value (or exception argument) whose `str()` raises, as an int of more than 4300 digits does. (Its
    repr works, so hypothesis can print a failing example; the regression tests use the int itself.)"""

    def __str__(self) -> str:
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    def __repr__(self) -> str:
        return "Unprintable()"


texts = st.one_of(
    st.text(),
    st.lists(st.sampled_from(['{"', '"}', "[", "]", ":", ",", "\n", "\u2028", "\\", "null", "é", "\ud800"])).map(
        "".join
    ),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
python_objects = st.one_of(
    st.binary(),
    st.sets(st.integers(), max_size=3),
    st.tuples(st.integers()),
    st.complex_numbers(),
    st.decimals(),
    st.floats(),  # nan and inf too
    st.builds(object),
    st.builds(Unprintable),
)
param_names = st.sampled_from(["count", "ratio", "mode", "flag", "note", "items", "grid", "table", "spec", "tags", "x"])
valid_typed = st.fixed_dictionaries(
    {
        "count": st.integers(),
        "ratio": st.floats(allow_nan=False) | st.integers(),
        "mode": st.sampled_from(["add", "mul"]),
    },
    optional={
        "flag": st.booleans(),
        "note": st.none() | st.text(),
        "items": st.none() | st.lists(st.integers(), max_size=3),
        "grid": st.none() | st.lists(st.lists(st.floats(allow_nan=False), max_size=3), max_size=3),
        "table": st.none() | st.dictionaries(st.text(), st.integers(), max_size=3),
    },
)
arguments = st.one_of(
    json_values,
    json_values.map(json.dumps),  # arguments as a JSON string, as some models write them
    texts,  # mostly invalid JSON
    st.integers(4000, 6000).map(lambda n: "9" * n),  # more digits than Python turns into an int
    st.integers(1, 3000).map(lambda n: "[" * n),  # nesting past the JSON decoder's limit
    python_objects,
    st.dictionaries(param_names | texts, json_values | python_objects, max_size=4),  # near misses
    st.dictionaries(st.integers() | st.none() | st.tuples(st.integers()), json_values, min_size=1, max_size=3),
    valid_typed,
    valid_typed.map(json.dumps),
)
names = st.one_of(st.sampled_from(sorted(TOOLS)), texts, st.none(), st.integers(), st.lists(st.integers(), max_size=2))


def run(tools: dict[str, Tool], name: Any, args: Any):
    return asyncio.run(execute_tool_call(tools, name, args))


def one_line(text: str) -> bool:
    return len(text.splitlines()) == 1


def marker_len(full: int, kept: int) -> int:
    return len(f"\n...[truncated {full - kept} chars]")


def check_failure(result) -> None:
    """A failure the framework reports: a known kind and one short line."""
    assert result.error in ERROR_KINDS
    assert result.output.startswith("Error: ") and one_line(result.output), result.output
    assert len(result.output) <= MAX_ERROR_CHARS


@settings(max_examples=examples(500), deadline=None)
@given(names, arguments)
def test_any_name_and_arguments(name, args):
    result = run(TOOLS, name, args)
    if result.error is not None:
        check_failure(result)
        assert result.error != "timeout"
    else:
        t = TOOLS[name]
        assert len(result.output) <= t.max_output_chars + marker_len(10**9, 0)
    if not isinstance(name, str) or name not in TOOLS:
        assert result.error == "unknown_tool"
    elif not isinstance(args, dict | str):
        assert result.error == "invalid_arguments"


@settings(max_examples=examples(200), deadline=None)
@given(valid_typed, st.booleans())
def test_valid_arguments_reach_the_function(args, as_json):
    result = run(TOOLS, "typed", json.dumps(args) if as_json else args)
    assert result.error is None, result.output
    defaults = dict(flag=False, note=None, items=None, grid=None, table=None)
    assert json.loads(result.output) == defaults | args


# --- tools that misbehave: raise anything, return anything --------------------------------------------

EXCEPTION_TYPES = [
    ValueError, TypeError, RuntimeError, KeyError, IndexError, ZeroDivisionError, OSError, TimeoutError,
    StopIteration, StopAsyncIteration, RecursionError, AssertionError, NotImplementedError, UnicodeError,
    asyncio.TimeoutError, json.JSONDecodeError, decimal.InvalidOperation,
]  # fmt: skip
exception_types = st.one_of(
    st.sampled_from(EXCEPTION_TYPES),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00")).map(lambda n: type(n, (Exception,), {})),
)
messages = st.one_of(texts, st.builds(Unprintable), st.text(min_size=2000, max_size=3000))
returned = st.one_of(
    json_values,
    python_objects,
    st.integers(0, 20_000).map(lambda n: "line\n" * n),  # long, many lines
    st.builds(ToolResult, output=texts, reward=st.none() | st.floats(), error=st.none() | texts),
    st.builds(ToolResult, output=st.just(Unprintable())),
)


def make_exception(cls: type, message: Any) -> BaseException:
    if cls is json.JSONDecodeError:  # the one that takes more than a message
        return cls("Expecting value", "{", 1)
    return cls(message)


def make_fn(behaviour: str, how: str, payload: Any):
    """A tool function that returns or raises `payload`: plain, async, or a sync one handing back a coroutine."""

    def act() -> Any:
        if behaviour == "raise":
            raise payload
        return payload

    async def async_act() -> Any:
        return act()

    if how == "sync":
        return lambda: act()
    if how == "async":
        return async_act
    return lambda: async_act()


def expect_text(value: Any) -> str | None:
    try:
        return str(value)
    except Exception:
        return None


@settings(max_examples=examples(400), deadline=None)
@given(
    st.one_of(
        st.tuples(st.just("raise"), st.builds(make_exception, exception_types, messages)),
        st.tuples(st.just("return"), returned),
    ),
    st.sampled_from(["sync", "async", "coroutine"]),
    st.integers(1, 300),
)
def test_any_tool_behaviour(behaviour, how, max_chars):
    kind, payload = behaviour
    t = Tool("t", "Fuzzed.", {"type": "object", "properties": {}}, fn=make_fn(kind, how, payload), timeout=TIMEOUT,
             max_output_chars=max_chars)  # fmt: skip
    result = run({"t": t}, "t", {})
    assert result.error != "timeout"
    value = payload.output if isinstance(payload, ToolResult) else payload
    text = expect_text(value)
    if kind == "raise" or text is None:
        check_failure(result)
        assert result.error == "exception"
        return
    assert result.error == (payload.error if isinstance(payload, ToolResult) else None)
    assert result.truncated == (len(text) > max_chars)
    if result.truncated:
        assert result.output.startswith(text[:max_chars])
        assert len(result.output) == max_chars + marker_len(len(text), max_chars)
    else:
        assert result.output == text


# --- the bugs fuzzing found, one plain test each --------------------------------------------------------


def test_regression_deeply_nested_json_arguments_are_invalid_arguments():
    """A JSON string nested 100k deep made `json.loads` raise RecursionError out of the call."""
    result = run(TOOLS, "typed", "[" * 100_000)
    check_failure(result)
    assert result.error == "invalid_arguments" and "nested too deeply" in result.output


def test_regression_json_number_too_long_is_invalid_arguments():
    """A 5000-digit integer in JSON arguments made `json.loads` raise ValueError."""
    result = run(TOOLS, "typed", '{"count": ' + "1" * 5000 + "}")
    check_failure(result)
    assert result.error == "invalid_arguments"


def test_regression_stop_iteration_is_an_exception_not_a_timeout():
    """A sync tool raising StopIteration (`next()` on an empty iterator) could not be set on the asyncio
    future, which then never finished: the call was reported as a timeout, `timeout` seconds later."""

    def first_match() -> str:
        return next(x for x in [] if x)

    t = Tool("first", "", {"type": "object", "properties": {}}, fn=first_match, timeout=TIMEOUT)
    result = run({"first": t}, "first", {})
    assert result.error == "exception" and "StopIteration" in result.output and result.seconds < 1


def test_regression_unprintable_return_values_and_exceptions():
    """`str()` of what a tool returned or raised was outside the try: an int of 5000 digits (or a broken
    `__str__`) raised ValueError out of the call."""
    for how, payload in [("return", 10**5000), ("return", Unprintable()), ("raise", ValueError(10**5000))]:
        t = Tool("t", "", {"type": "object", "properties": {}}, fn=make_fn(how, "sync", payload), timeout=TIMEOUT)
        result = run({"t": t}, "t", {})
        check_failure(result)
        assert result.error == "exception"


def test_regression_exception_class_name_with_a_newline_stays_one_line():
    bad = type("Bad\nName", (Exception,), {})
    t = Tool("t", "", {"type": "object", "properties": {}}, fn=make_fn("raise", "sync", bad("x\ny")), timeout=TIMEOUT)
    check_failure(run({"t": t}, "t", {}))


def test_regression_unprintable_argument_values_are_invalid_arguments():
    """jsonschema puts the repr of a wrong value in its message: a value whose repr raises (here a
    5000-digit int where a string belongs) made validation itself raise."""
    result = run(TOOLS, "typed", {"count": 1, "ratio": 1.0, "mode": "add", "note": 10**5000})
    check_failure(result)
    assert result.error == "invalid_arguments"
