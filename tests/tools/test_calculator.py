"""Tests of the calculator: right answers, and fast, clear refusals of everything else."""

from __future__ import annotations

import re
import time

import pytest

from agent_r1.tools import BUILTIN_TOOLS, calculator, execute_tool_call
from agent_r1.tools.calculator import evaluate, format_number


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", "7"),  # precedence
        ("(1 + 2) * 3", "9"),
        ("2 ** 3 ** 2", "512"),  # ** is right-associative
        ("-2 ** 2", "-4"),  # unary minus binds looser than **
        ("-(3 - 5)", "2"),
        ("+4 - -4", "8"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("6 / 3", "2"),  # integral float printed as an integer
        ("1 / 3", "0.3333333333"),  # 10 significant digits
        ("2 / 3", "0.6666666667"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** -3", "0.125"),
        ("1.5 * 4", "6"),
        ("48 / 2 * 3 + 1", "73"),
        ("123456789 * 987654321", str(123456789 * 987654321)),
        ("10 ** 100", str(10**100)),
        ("1,000 * 3", "3000"),  # thousands separators
        ("1,234,567 + 1", "1234568"),
        ("3 × 4 ÷ 2", "6"),  # unicode operators
        (" 5 * 5 = ", "25"),  # trailing '='
    ],
)
def test_values(expression: str, expected: str) -> None:
    assert calculator(expression) == expected


def test_format_number() -> None:
    assert format_number(2.0) == "2"
    assert format_number(-0.0) == "0"
    assert format_number(1234.5678) == "1234.5678"
    assert format_number(1 / 7) == "0.1428571429"
    assert format_number(1e-20) == "1e-20"
    assert format_number(2.0**60) == "1.152921505e+18"  # beyond 2**53 floats are not exact integers


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9**9**9", "exponent too large"),
        ("10**1000", "exponent too large"),
        ("10**99 * 100", "result too large"),
        ("(10**50) ** 3", "result too large"),
        ("__import__('os')", "function calls are not allowed: '__import__'"),
        ("().__class__", "attribute access is not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("a+1", "names are not allowed: 'a'"),
        ("'x'*3", "strings are not allowed"),
        ("1" * 40, "number too long: 40 digits"),
        ("1+" * 250 + "1", "expression too long: 501 chars"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("[1,2]", "lists are not allowed"),
        ("lambda: 1", "lambdas are not allowed"),
        ("(1,2)[0]", "subscripts are not allowed"),
        ("1 < 2", "comparisons are not allowed"),
        ("True + 1", "True is not a number"),
        ("2j", "complex numbers are not allowed"),
        ("(-8) ** 0.5", "result is not a real number"),
        ("1e999", "number too large"),
        ("2 ^ 3", "operator '^' is not allowed (use ** for powers)"),
        ("1 +", "could not parse expression"),
        ("import os", "could not parse expression"),
        ("", "empty expression"),
    ],
)
def test_rejected_quickly_with_a_clear_message(expression: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ValueError, match="^" + re.escape(message)) as e:
        evaluate(expression)
    assert time.perf_counter() - start < 0.1
    assert "\n" not in str(e.value)


async def test_error_becomes_the_observation() -> None:
    r = await execute_tool_call(BUILTIN_TOOLS, "calculator", {"expression": "9**9**9"})
    assert r.error == "exception"
    assert r.output == "Error: calculator raised ValueError: exponent too large: 387420489 (at most 100)"
    assert r.seconds < 0.1
