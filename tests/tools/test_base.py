"""Tests of the tool contract: schema generation, and every way a tool call can go wrong."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent_r1.tools import BUILTIN_TOOLS, Tool, ToolResult, calculator, echo, execute_tool_call, tool


def add(a: int, b: float = 1.0, note: str | None = None) -> float:
    """Add two numbers.

    Used to check the schema.

    Args:
        a: The first number.
        b: The second number.
        note: An optional note.
    """
    return a + b


def test_schema_from_hints_and_docstring() -> None:
    t = tool(add)
    assert t.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.\n\nUsed to check the schema.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "number", "description": "The second number."},
                    "note": {"type": "string", "nullable": True, "description": "An optional note."},
                },
                "required": ["a"],
            },
        },
    }
    assert (t.timeout, t.max_output_chars) == (10.0, 4000)
    assert t(2, 3.0) == 5.0  # a decorated function stays callable


def test_bare_decorator() -> None:
    @tool
    def shout(text: str) -> str:
        """Upper-case a text.

        Args:
            text: The text.
        """
        return text.upper()

    assert isinstance(shout, Tool)
    assert shout.name == "shout"
    assert shout.description == "Upper-case a text."
    assert shout("hi") == "HI"


def test_parametrised_decorator() -> None:
    @tool(name="x", description="Custom.", timeout=2.0, max_output_chars=100)
    def shout(text: str) -> str:
        """Upper-case a text.

        Args:
            text: The text.
        """
        return text.upper()

    assert (shout.name, shout.description, shout.timeout, shout.max_output_chars) == (
        "x",
        "Custom.",
        2.0,
        100,
    )
    assert shout.schema["function"]["name"] == "x"


def test_missing_docstring_is_a_clear_error() -> None:
    def nodoc(a: int) -> int:
        return a

    with pytest.raises(TypeError, match=r"^@tool cannot build a schema for nodoc: .*docstring") as e:
        tool(nodoc)
    assert "\n" not in str(e.value)


def test_untyped_argument_is_a_clear_error() -> None:
    def untyped(a):  # type: ignore[no-untyped-def]
        """Do nothing.

        Args:
            a: Something.
        """

    with pytest.raises(TypeError, match=r"^@tool cannot build a schema for untyped: .*type hint"):
        tool(untyped)


def test_builtin_tools() -> None:
    assert {"calculator": calculator, "echo": echo} == BUILTIN_TOOLS


async def test_success() -> None:
    r = await execute_tool_call(BUILTIN_TOOLS, "echo", {"text": "hello"})
    assert (r.name, r.arguments, r.output, r.error, r.truncated, r.reward) == (
        "echo",
        {"text": "hello"},
        "hello",
        None,
        False,
        None,
    )
    assert 0 <= r.seconds < 1


async def test_non_string_return_value_is_stringified() -> None:
    r = await execute_tool_call({"add": tool(add)}, "add", {"a": 2})
    assert (r.output, r.error) == ("3.0", None)


async def test_unknown_tool() -> None:
    r = await execute_tool_call(BUILTIN_TOOLS, "foo", {"text": "x"})
    assert r.error == "unknown_tool"
    assert r.output == "Error: unknown tool 'foo'. Available tools: calculator, echo."


async def test_json_string_arguments() -> None:
    r = await execute_tool_call(BUILTIN_TOOLS, "calculator", '{"expression": "2 + 3"}')
    assert (r.output, r.error, r.arguments) == ("5", None, {"expression": "2 + 3"})


@pytest.mark.parametrize("arguments", ['{"expression": "2 + 3"', "not json", "", None, 42, ["2 + 3"], '"2+3"'])
async def test_unparseable_arguments(arguments: object) -> None:
    r = await execute_tool_call(BUILTIN_TOOLS, "calculator", arguments)
    assert r.error == "invalid_arguments"
    assert r.output.startswith("Error: invalid arguments for calculator: ")
    assert "\n" not in r.output


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"expression": 5}, "Error: invalid arguments for calculator: expression: 5 is not of type 'string'"),
        ({}, "Error: invalid arguments for calculator: 'expression' is a required property"),
        (
            {"expression": "1", "mode": "x"},
            "Error: invalid arguments for calculator: Additional properties are not allowed ('mode' was unexpected)",
        ),
    ],
    ids=["wrong_type", "missing_required", "extra_argument"],
)
async def test_invalid_arguments(arguments: dict, message: str) -> None:
    r = await execute_tool_call(BUILTIN_TOOLS, "calculator", arguments)
    assert (r.error, r.output) == ("invalid_arguments", message)


async def test_nullable_argument_accepts_null() -> None:
    r = await execute_tool_call({"add": tool(add)}, "add", {"a": 1, "note": None})
    assert (r.error, r.output) == (None, "2.0")


async def test_huge_invalid_argument_gives_a_short_message() -> None:
    r = await execute_tool_call(BUILTIN_TOOLS, "echo", {"text": ["x" * 100_000]})
    assert r.error == "invalid_arguments"
    assert len(r.output) < 500


async def test_tool_that_raises() -> None:
    @tool
    def boom(text: str) -> str:
        """Always fail.

        Args:
            text: Ignored.
        """
        raise ValueError("bad\nthing " + "x" * 1000)

    r = await execute_tool_call({"boom": boom}, "boom", {"text": "a"})
    assert r.error == "exception"
    assert r.output.startswith("Error: boom raised ValueError: bad thing xxx")
    assert "\n" not in r.output and len(r.output) < 400


async def test_tool_raising_timeout_error_is_an_exception_not_a_timeout() -> None:
    @tool
    async def net(text: str) -> str:
        """Fail like a network call.

        Args:
            text: Ignored.
        """
        raise TimeoutError("upstream")

    r = await execute_tool_call({"net": net}, "net", {"text": "a"})
    assert (r.error, r.output) == ("exception", "Error: net raised TimeoutError: upstream")


async def test_sync_tool_that_hangs_times_out() -> None:
    @tool(timeout=0.2)
    def hang(text: str) -> str:
        """Sleep too long.

        Args:
            text: Ignored.
        """
        time.sleep(2)
        return text

    start = time.perf_counter()
    r = await execute_tool_call({"hang": hang}, "hang", {"text": "a"})
    assert time.perf_counter() - start < 1.5
    assert (r.error, r.output) == ("timeout", "Error: tool hang timed out after 0.2s")


async def test_async_tool_that_hangs_times_out() -> None:
    @tool(timeout=0.2)
    async def hang(text: str) -> str:
        """Sleep too long.

        Args:
            text: Ignored.
        """
        await asyncio.sleep(60)
        return text

    start = time.perf_counter()
    r = await execute_tool_call({"hang": hang}, "hang", {"text": "a"})
    assert time.perf_counter() - start < 1.5
    assert (r.error, r.output) == ("timeout", "Error: tool hang timed out after 0.2s")


async def test_sync_tools_run_concurrently() -> None:
    @tool
    def nap(text: str) -> str:
        """Sleep a little.

        Args:
            text: Returned.
        """
        time.sleep(0.2)
        return text

    start = time.perf_counter()
    results = await asyncio.gather(*(execute_tool_call({"nap": nap}, "nap", {"text": str(i)}) for i in range(8)))
    assert time.perf_counter() - start < 1.0  # 8 x 0.2 s in sequence would take 1.6 s
    assert [r.output for r in results] == [str(i) for i in range(8)]


async def test_huge_output_is_truncated() -> None:
    @tool(max_output_chars=100)
    def flood(text: str) -> str:
        """Return 5 MB.

        Args:
            text: Repeated.
        """
        return text * 5_000_000

    r = await execute_tool_call({"flood": flood}, "flood", {"text": "a"})
    assert r.truncated and r.error is None
    assert r.output == "a" * 100 + "\n...[truncated 4999900 chars]"


async def test_tool_result_reward_is_passed_through() -> None:
    @tool
    async def graded(text: str) -> ToolResult:
        """Echo with a reward.

        Args:
            text: Returned.
        """
        return ToolResult(output=text, reward=0.5)

    r = await execute_tool_call({"graded": graded}, "graded", {"text": "ok"})
    assert (r.output, r.reward, r.error) == ("ok", 0.5, None)


def test_invalid_tool_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="tool name"):
        Tool(name="bad name", description="", parameters={"type": "object", "properties": {}}, fn=print)
