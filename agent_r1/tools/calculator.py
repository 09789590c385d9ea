"""A safe arithmetic calculator, the default tool of the calculator and GSM8K tasks.

The model controls the input, so this never calls `eval`: the expression is parsed with `ast` and
only numbers, + - * / // % ** and parentheses are evaluated. Sizes are bounded *before* computing,
so an input like `9**9**9` is rejected in microseconds instead of freezing a rollout worker. Errors
raise `ValueError` with a message meant for the model; `execute_tool_call` turns it into the
observation.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

from agent_r1.tools.base import tool

MAX_EXPRESSION_CHARS = 200
MAX_LITERAL_DIGITS = 30
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100  # bound on literals, intermediate values and the result

Number = int | float

_BINARY_OPS: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
# Rejected operators, spelled as the model wrote them, for the error message.
_OPERATOR_SYMBOLS = {
    ast.BitXor: "^",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}
# Messages for rejected node kinds; anything else is named by its ast class.
_REJECTED_NODES = {
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "subscripts are not allowed",
    ast.List: "lists are not allowed",
    ast.Tuple: "tuples are not allowed",
    ast.Dict: "dicts are not allowed",
    ast.Set: "sets are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "boolean operators are not allowed",
    ast.IfExp: "conditional expressions are not allowed",
    ast.JoinedStr: "strings are not allowed",
    ast.Starred: "starred expressions are not allowed",
    ast.NamedExpr: "assignments are not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed",
}
# "1,000" -> "1000": a comma between a digit and exactly three digits is a thousands separator.
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_UNICODE_OPERATORS = str.maketrans({"×": "*", "÷": "/", "−": "-"})


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Supports numbers, + - * / // % ** and parentheses (no variables or functions).

    Args:
        expression: The arithmetic expression, for example "(48 / 2) * 3 + 1".
    """
    return format_number(evaluate(expression))


def evaluate(expression: str) -> Number:
    """The value of a bounded arithmetic expression; ValueError with a model-readable message if not."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression too long: {len(expression)} chars (at most {MAX_EXPRESSION_CHARS})")
    source = _normalize(expression)
    if not source:
        raise ValueError("empty expression")
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError):  # ValueError: null bytes
        raise ValueError(f"could not parse expression: {source!r}") from None
    return _eval(tree.body, source)


def format_number(x: Number) -> str:
    """Integers (and integral floats such as 6/3) as integers, else 10 significant digits."""
    if isinstance(x, int):
        return str(x)
    if x.is_integer() and abs(x) < 2**53:  # beyond 2**53 the float's digits are not exact
        return str(int(x))
    return f"{x:.10g}"


def _normalize(expression: str) -> str:
    """Accept common spellings models use: a trailing '=', '×' '÷' '−', and '1,000'."""
    source = expression.strip().rstrip("=").strip()
    source = source.translate(_UNICODE_OPERATORS)
    return _THOUSANDS_COMMA.sub("", source)


def _eval(node: ast.expr, source: str) -> Number:
    """Evaluate an allowed node; every value is checked against MAX_MAGNITUDE as it is produced."""
    if isinstance(node, ast.Constant):
        return _literal(node, source)
    if isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY_OPS:
            raise _bad_operator(node.op)
        return _UNARY_OPS[type(node.op)](_eval(node.operand, source))
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, source), _eval(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if type(node.op) not in _BINARY_OPS:
            raise _bad_operator(node.op)
        try:
            return _checked(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    if isinstance(node, ast.Name):
        raise ValueError(f"names are not allowed: {node.id!r}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        raise ValueError(f"function calls are not allowed: {node.func.id!r}")
    problem = _REJECTED_NODES.get(type(node), f"{type(node).__name__} is not allowed")
    raise ValueError(f"{problem}; use only numbers, + - * / // % ** and parentheses")


def _bad_operator(op: ast.operator | ast.unaryop) -> ValueError:
    """The error for an operator outside the allowed set; `^` gets a hint because models mean power."""
    symbol = _OPERATOR_SYMBOLS.get(type(op), type(op).__name__)
    hint = " (use ** for powers)" if isinstance(op, ast.BitXor) else ""
    return ValueError(f"operator '{symbol}' is not allowed{hint}")


def _literal(node: ast.Constant, source: str) -> Number:
    """A number literal within the digit and magnitude bounds; bools, strings, complex are rejected."""
    value = node.value
    if isinstance(value, bool) or value is None or value is Ellipsis:
        raise ValueError(f"{value!r} is not a number")
    if isinstance(value, str | bytes):
        raise ValueError("strings are not allowed; use only numbers")
    if isinstance(value, complex):
        raise ValueError("complex numbers are not allowed")
    digits = sum(c.isdigit() for c in ast.get_source_segment(source, node) or "")
    if digits > MAX_LITERAL_DIGITS:
        raise ValueError(f"number too long: {digits} digits (at most {MAX_LITERAL_DIGITS})")
    if not abs(value) <= MAX_MAGNITUDE:  # e.g. 1e999, which Python reads as inf
        raise ValueError(f"number too large (more than {MAX_MAGNITUDE:g})")
    return value


def _power(base: Number, exponent: Number) -> Number:
    """base ** exponent, refused *before* computing when the exponent or the result would be huge."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent too large: {format_number(exponent)} (at most {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise ValueError("division by zero")
    if base != 0 and math.log10(abs(base)) * exponent > math.log10(MAX_MAGNITUDE):
        raise ValueError(f"result too large (more than {MAX_MAGNITUDE:g})")
    result = base**exponent
    if isinstance(result, complex):  # e.g. (-8) ** 0.5
        raise ValueError("result is not a real number")
    return result


def _checked(x: Number) -> Number:
    """`x` if its magnitude is within MAX_MAGNITUDE (this also rejects inf and nan)."""
    if not abs(x) <= MAX_MAGNITUDE:
        raise ValueError(f"result too large (more than {MAX_MAGNITUDE:g})")
    return x
