"""Fuzzing every family's tool-call parser (agent_r1.env.tool_formats), as test_tool_calls_fuzz.py does
hermes: no response text makes a parser raise, every result is a call or a one-line `ParseError`, and
every call a family's `format_call` writes parses back to itself."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.env.tool_calls import ParsedCall, ParseError
from agent_r1.env.tool_formats import TOOL_FORMATS
from tests.conftest import examples
from tests.env.test_tool_calls_fuzz import FRAGMENTS, one_line

# the syntax of the other families, whole and cut, beside hermes' own pieces
FAMILY_FRAGMENTS = [
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL_CALLS", "ARGS]", "<|python_tag|>", "<|eot_id|>", "<|eom_id|>",
    "<function=", "</function>", "<parameter=", "</parameter>", "<function=forecast>", "<parameter=days>", ">",
    "<|channel|>", "<|message|>", "<|call|>", "<|end|>", "<|start|>", "<|return|>", "<|constrain|>", " to=",
    "to=functions.", "commentary", "final", ";", '{"name": "a", "parameters": {}}', '[{"name": "a", "arguments": {}}]',
]  # fmt: skip
texts = st.one_of(
    st.text(),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS + FAMILY_FRAGMENTS), st.text(max_size=6)), max_size=40).map("".join),
)
PROPERTIES = {"days": {"type": "integer"}, "units": {"type": "array"}, "city": {"type": "string"}}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
SCHEMAS = {"forecast": {"type": "function", "function": {"name": "forecast", "parameters": {"properties": PROPERTIES}}}}
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,20}", fullmatch=True)


@settings(max_examples=examples(300), deadline=None)
@given(texts, st.sampled_from(sorted(TOOL_FORMATS)))
def test_no_text_makes_any_family_raise(text, family):
    for r in TOOL_FORMATS[family].parse(text, SCHEMAS):
        assert isinstance(r, ParsedCall | ParseError)
        if isinstance(r, ParseError):
            assert one_line(r.message), r.message
        else:
            assert isinstance(r.name, str)


@settings(max_examples=examples(300), deadline=None)
@given(st.sampled_from(["hermes", "llama3_json", "mistral", "mistral_args", "harmony"]), names, json_values)
def test_every_json_familys_calls_round_trip(family, name, args):
    """Names and arguments of any JSON: tags, quotes, backslashes, unicode in the strings."""
    fmt = TOOL_FORMATS[family]
    if family == "llama3_json" and not isinstance(args, dict):
        args = {"value": args}  # a Llama 3 call's parameters are an object
    assert fmt.parse(fmt.format_call(name, args), SCHEMAS) == [ParsedCall(name, args)]


# Qwen3-Coder writes values as text between tags, unescaped (as its template does): a string holding
# `</parameter>` cannot round-trip in that format, so strings here hold none of its tags
plain = st.text().filter(lambda s: not any(t in s for t in ("<parameter=", "</parameter>", "</function>")))


@settings(max_examples=examples(300), deadline=None)
@given(plain.filter(lambda s: "\n" not in s[:1] + s[-1:]), st.integers(), st.lists(json_values, max_size=3))
def test_qwen3_coder_calls_round_trip_with_their_schema_types(city, days, units):
    args = {"city": city, "days": days, "units": units}
    fmt = TOOL_FORMATS["qwen3_coder"]
    assert fmt.parse(fmt.format_call("forecast", args), SCHEMAS) == [ParsedCall("forecast", args)]
    assert json.loads(json.dumps(args)) == args
