"""Fuzzing the tool-call parser: no response text, however broken, makes it raise.

Every `<tool_call>` block becomes exactly one result, a `ParsedCall` or a one-line `ParseError` the model
is shown, and every call `format_tool_call` writes parses back to itself.
"""

from __future__ import annotations

import json
import re
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.env.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    ParsedCall,
    ParseError,
    extract_answer,
    format_tool_call,
    parse_tool_calls,
)
from tests.conftest import examples

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

# Pieces that models really emit, and pieces that break parsers: tags whole and cut, JSON syntax,
# JSON extensions Python accepts (NaN), escapes, lone surrogates, NUL, and unicode line breaks.
FRAGMENTS = [
    CALL_OPEN, CALL_CLOSE, "<tool_call", "tool_call>", "</tool_call", ANSWER_OPEN, ANSWER_CLOSE, "<answer",
    "{", "}", "[", "]", ":", ",", '"', "\\", "\\u", "\n", "\r", " ", "\u2028", "\x00", "\ud800", "é", "🙂",
    '"name"', '"arguments"', '"parameters"', '"calculator"', "null", "true", "-0.5e3", "1e999", "NaN", "Infinity",
    '{"name": "calculator", "arguments": {"expression": "6 * 7"}}', '{"name": "echo", "arguments": "{\\"text\\": 1}"}',
]  # fmt: skip

texts = st.one_of(
    st.text(),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=40).map("".join),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)


def one_line(message: str) -> bool:
    return bool(message) and len(message.splitlines()) == 1


def call_blocks(text: str) -> int:
    """The `<tool_call>` blocks of `text`: each runs from an opening to the next closing (or the end),
    so an opening inside a block is part of that block's body (a JSON string may hold the tag)."""
    count, pos = 0, 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        count += 1
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end < 0:
            break
        pos = end + len(CALL_CLOSE)
    return count


@settings(max_examples=examples(400), deadline=None)
@given(texts)
def test_any_text_gives_one_result_per_call_block(text):
    results = parse_tool_calls(text)
    assert len(results) == call_blocks(text) <= text.count(CALL_OPEN)
    for r in results:
        assert isinstance(r, ParsedCall | ParseError)
        if isinstance(r, ParsedCall):
            assert isinstance(r.name, str)
        else:
            assert one_line(r.message), r.message


# JSON that the decoder itself refuses: more digits than Python turns into an int, nesting past its limit
hostile_json = st.integers(4000, 6000).map(lambda n: "9" * n) | st.integers(1, 3000).map(lambda n: "[" * n)
prose = texts.filter(lambda s: CALL_OPEN not in s and CALL_CLOSE not in s)
bodies = st.one_of(texts, json_values.map(json.dumps), hostile_json).filter(
    lambda s: CALL_OPEN not in s and CALL_CLOSE not in s
)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(prose, bodies), max_size=5), prose, st.booleans())
def test_every_opening_gives_exactly_one_result(blocks, tail, closed):
    """With no tag inside a body, the results are exactly one per `<tool_call>`, in order."""
    text = "".join(f"{before}{CALL_OPEN}{body}{CALL_CLOSE}" for before, body in blocks) + tail
    if not closed:
        text += CALL_OPEN + "{"  # a response cut off mid-call
    results = parse_tool_calls(text)
    assert len(results) == text.count(CALL_OPEN)
    if not closed:
        assert isinstance(results[-1], ParseError) and "unclosed" in results[-1].message


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(prose, texts, json_values), max_size=4), prose)
def test_formatted_calls_round_trip(calls, tail):
    """What `format_tool_call` writes (demonstrations, chat history, the server) parses back exactly,
    whatever the name and arguments hold: tags, quotes, backslashes, unicode."""
    text = "".join(before + format_tool_call(name, args) for before, name, args in calls) + tail
    assert parse_tool_calls(text) == [ParsedCall(name, args) for _, name, args in calls]


def _answer_by_regex(text: str) -> str | None:
    """`extract_answer` as first written: the last non-overlapping `<answer>...</answer>` match."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1].strip() if found else None


@settings(max_examples=examples(400), deadline=None)
@given(texts)
def test_extract_answer_takes_the_last_answer_tag(text):
    answer = extract_answer(text)
    assert answer == _answer_by_regex(text)
    opening = text.find(ANSWER_OPEN)
    has_tag = opening >= 0 and text.find(ANSWER_CLOSE, opening + len(ANSWER_OPEN)) >= 0
    assert (answer is not None) == has_tag
    assert answer is None or answer == answer.strip()


@settings(max_examples=examples(200), deadline=None)
@given(
    texts.filter(lambda s: ANSWER_OPEN not in s),
    texts.filter(lambda s: ANSWER_CLOSE not in s),
    texts.filter(lambda s: ANSWER_CLOSE not in s),
)
def test_extract_answer_finds_a_planted_answer(before, answer, after):
    assert extract_answer(f"{before}{ANSWER_OPEN}{answer}{ANSWER_CLOSE}{after}") == answer.strip()


# --- huge inputs: linear time, no recursion, no crash ------------------------------------------------


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def test_huge_inputs_parse_quickly():
    call = format_tool_call("calculator", {"expression": "1+2"})
    cases = {
        "a megabyte around a call": ("x" * 500_000 + call + "y" * 500_000, 1),
        "100k unclosed openings": (CALL_OPEN * 100_000, 1),
        "50k empty calls": ((CALL_OPEN + CALL_CLOSE) * 50_000, 50_000),
        "50k valid calls": (call * 50_000, 50_000),
    }
    for what, (text, n) in cases.items():
        results, seconds = timed(parse_tool_calls, text)
        assert len(results) == n and seconds < 10, what
        assert all(isinstance(r, ParsedCall) or one_line(r.message) for r in results), what


def test_regression_many_unclosed_answer_tags_take_linear_time():
    """`<answer>` repeated 100k times (a degenerate response) took minutes: the regex rescanned the
    rest of the text from every opening that has no closing after it."""
    for text in (ANSWER_OPEN * 100_000, ANSWER_OPEN * 100_000 + ANSWER_CLOSE + ANSWER_OPEN * 100_000):
        _, seconds = timed(extract_answer, text)
        assert seconds < 5
    assert extract_answer(ANSWER_OPEN * 3 + "7" + ANSWER_CLOSE + ANSWER_OPEN * 3) == ANSWER_OPEN * 2 + "7"


def test_regression_deeply_nested_call_is_a_parse_error():
    """`[` nested 100k deep made `json.loads` raise RecursionError out of the parser."""
    (err,) = parse_tool_calls(CALL_OPEN + "[" * 100_000 + CALL_CLOSE)
    assert isinstance(err, ParseError) and "nested too deeply" in err.message and one_line(err.message)


def test_regression_number_too_long_for_int_is_a_parse_error():
    """An integer of 5000 digits (a model repeating a digit) made `json.loads` raise ValueError: Python
    refuses to convert more than 4300 digits to an int."""
    (err,) = parse_tool_calls(CALL_OPEN + '{"name": "calculator", "arguments": {"x": ' + "1" * 5000 + "}}" + CALL_CLOSE)
    assert isinstance(err, ParseError) and "not valid JSON" in err.message and one_line(err.message)


def test_regression_closing_tag_inside_an_argument_round_trips():
    """`format_tool_call` wrote a `</tool_call>` inside a JSON string as is, so the call ended there."""
    args = {"text": f"say {CALL_CLOSE} and {CALL_OPEN}"}
    text = format_tool_call("echo", args)
    assert text.count(CALL_CLOSE) == 1
    assert parse_tool_calls(text) == [ParsedCall("echo", args)]
