"""Fuzzing `agent-r1 serve`: no request body makes the server answer 5xx.

Every POST endpoint gets arbitrary JSON, near-valid requests with fields replaced by anything, and bytes
that are not JSON at all. A bad body is a 4xx with an OpenAI-style `{"error": {...}}`; a good one is
served (streams included, and a stream never carries a server error). A tiny random model answers,
with a few tokens per request, so each request takes milliseconds.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.serve import ServedModel, create_app
from agent_r1.tools import calculator
from tests.conftest import examples, make_tiny_llama

NAME = "fuzz-model"
CHAT, COMPLETIONS, WEIGHTS = "/v1/chat/completions", "/v1/completions", "/v1/load_weights"


@pytest.fixture(scope="module")
def client(tokenizer):
    model = make_tiny_llama(len(tokenizer), hidden=32, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    engine = LocalEngine(model, tokenizer, max_context=512, seed=0)  # room for a tools system prompt
    served = ServedModel(
        engine, tokenizer, ChatFormat(tokenizer), NAME, engine.eos_ids, request_timeout=60.0, default_max_tokens=4,
        allow_weight_updates=True,  # so load_weights checks the path instead of refusing every body
    )  # fmt: skip
    with TestClient(create_app(served), raise_server_exceptions=False) as c:  # a 500 is a response here
        yield c


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def field(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right shape, sometimes any JSON at all."""
    return st.one_of(good, good, json_values)


schemas = st.one_of(
    st.just(calculator.schema["function"]["parameters"]),
    st.fixed_dictionaries(
        {"type": field(st.sampled_from(["object", "array", "bogus"]))},
        optional={
            "properties": field(
                st.dictionaries(st.text(max_size=5), field(st.sampled_from([{"type": "string"}, {"type": "x"}])))
            ),
            "required": json_values,
            "nullable": json_values,
            "$schema": field(st.sampled_from(["https://json-schema.org/draft/2020-12/schema", "urn:nope"])),
            "$ref": field(st.sampled_from(["#", "#/nope", "http://127.0.0.1:9/schema.json"])),
        },
    ),
)
tool_specs = st.fixed_dictionaries(
    {
        "type": field(st.just("function")),
        "function": field(
            st.fixed_dictionaries(
                {"name": field(st.sampled_from(["calculator", "a-b_c", "bad name", ""]))},
                optional={"description": field(st.text(max_size=20)), "parameters": field(schemas)},
            )
        ),
    }
)
# JSON that the decoder refuses: more digits than Python turns into an int, nesting past its limit
hostile_json = st.one_of(
    st.text(), st.integers(4000, 6000).map(lambda n: "9" * n), st.integers(1, 3000).map(lambda n: "[" * n)
)
tool_calls = st.fixed_dictionaries(
    {
        "function": field(
            st.fixed_dictionaries(
                {"name": field(st.text(max_size=10)), "arguments": field(json_values.map(json.dumps) | hostile_json)}
            )
        )
    },
    optional={"id": field(st.text(max_size=8)), "type": field(st.just("function"))},
)
content_parts = st.fixed_dictionaries(
    {"type": field(st.sampled_from(["text", "image_url"]))}, optional={"text": field(st.text(max_size=20))}
)
messages = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]))},
    optional={
        "content": field(st.none() | st.text(max_size=40) | st.lists(content_parts, max_size=2)),
        "tool_calls": field(st.lists(tool_calls, max_size=2)),
        "tool_call_id": field(st.text(max_size=8)),
    },
)
token_ids = st.lists(st.integers(-3, 50_000), max_size=6)  # the vocabulary has 49152 ids
FIELDS = {
    "model": st.just(NAME) | st.text(max_size=10),
    "messages": st.lists(messages, max_size=4),
    "tools": st.lists(tool_specs, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "max_tokens": st.integers(-1, 6) | st.integers(),
    "max_completion_tokens": st.integers(-1, 6),
    "temperature": st.floats(),
    "top_p": st.floats(),
    "seed": st.integers() | st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64]),  # 64-bit bounds
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stream": st.booleans(),
    "n": st.integers(-1, 4),
    "logprobs": st.booleans() | st.integers(-1, 3),
    "echo": st.booleans(),
    "return_token_ids": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "prompt": st.one_of(token_ids, st.lists(token_ids, max_size=3), st.text(max_size=30), st.lists(st.text())),
    "path": st.text(max_size=30),
    "version": st.integers(),
}
BASES = {
    CHAT: {"model": NAME, "messages": [{"role": "user", "content": "What is 6 * 7?"}], "max_tokens": 2},
    COMPLETIONS: {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 2},
    WEIGHTS: {"path": "/nonexistent/weights.safetensors"},
}
SAMPLING = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "n",
    "logprobs",
    "return_token_ids",
]
ENDPOINT_FIELDS = {  # the fields each endpoint reads; it ignores the others
    CHAT: [*SAMPLING, "messages", "tools", "tool_choice", "max_completion_tokens"],
    COMPLETIONS: [*SAMPLING, "prompt", "echo", "return_tokens_as_token_ids", "include_stop_str_in_output"],
    WEIGHTS: ["path", "version"],
}


WILD = {key: field(good) for key, good in FIELDS.items()}  # FIELDS as written hold right-shaped values only


@st.composite
def near_valid(draw, path: str, fields: dict[str, st.SearchStrategy], changes: int = 4) -> dict:
    """A valid body for `path` with a field dropped and up to `changes` fields set (mostly its own)."""
    body = dict(BASES[path])
    for key in draw(st.sets(st.sampled_from(sorted(body)), max_size=1 if changes > 1 else 0)):
        del body[key]
    keys = st.sampled_from(ENDPOINT_FIELDS[path]) | st.sampled_from(sorted(fields))
    for key in draw(st.lists(keys, unique=True, min_size=1, max_size=changes)):
        body[key] = draw(fields[key])
    return body


def bodies_for(path: str) -> st.SearchStrategy:
    # one field changed reaches the deepest code: the rest of the request is valid
    return st.one_of(near_valid(path, FIELDS, 1), near_valid(path, FIELDS), near_valid(path, WILD), json_values)


bodies = st.sampled_from(sorted(BASES)).flatmap(lambda path: st.tuples(st.just(path), bodies_for(path)))


def check(response) -> None:
    """Below 500 always; a refusal is an OpenAI-style error, a stream ends cleanly."""
    assert response.status_code < 500, response.text
    event(f"HTTP {response.status_code}")  # `--hypothesis-show-statistics` shows the mix
    if response.status_code >= 400:
        assert isinstance(response.json()["error"]["message"], str)
    elif response.headers["content-type"].startswith("text/event-stream"):
        lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        for line in lines[:-1]:
            assert json.loads(line).get("error", {}).get("type") != "server_error", line
    else:
        assert "choices" in response.json() or "loaded" in response.json()


@settings(max_examples=examples(250), deadline=None)
@given(bodies)
def test_any_json_body(client, path_and_body):
    path, body = path_and_body
    check(client.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))


CONTENT_TYPES = [None, "application/json", "text/plain", "application/x-www-form-urlencoded", "application/ld+json"]


@settings(max_examples=examples(100), deadline=None)
@given(
    st.sampled_from(sorted(BASES)),
    st.one_of(
        st.binary(),
        st.text().map(lambda s: s.encode("utf-8", "surrogatepass")),
        bodies.map(lambda pb: json.dumps(pb[1]).encode()).flatmap(  # valid JSON cut short
            lambda raw: st.integers(0, len(raw)).map(lambda n: raw[:n])
        ),
        st.sampled_from([b"NaN", b'{"temperature": NaN}', b'{"top_p": Infinity}', b"[" * 100_000, b'"' * 3]),
    ),
    st.sampled_from(CONTENT_TYPES),
)
def test_any_bytes(client, path, raw, content_type):
    headers = {"content-type": content_type} if content_type else {}
    check(client.post(path, content=raw, headers=headers))


# --- the bugs fuzzing found, one plain test each --------------------------------------------------------

CHAT_BODY = BASES[CHAT]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_regression_a_seed_out_of_64_bit_range_is_a_400(client, seed):
    """torch cannot seed a generator with it: the engine raised for the whole batch, a 500 for every
    request decoded with this one."""
    for path in (CHAT, COMPLETIONS):
        r = client.post(path, json=BASES[path] | {"seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_regression_the_64_bit_seed_range_is_served(client):
    for seed in (2**63 - 1, -(2**63)):
        assert client.post(COMPLETIONS, json=BASES[COMPLETIONS] | {"seed": seed, "n": 3}).status_code == 200
        assert client.post(CHAT, json=CHAT_BODY | {"seed": seed}).status_code == 200


@pytest.mark.parametrize("arguments", ["1" * 5000, "[" * 100_000])
def test_regression_tool_call_arguments_json_cannot_decode_are_a_400(client, arguments):
    """A 5000-digit number (ValueError) or 100k-deep nesting (RecursionError) in an assistant turn's
    tool-call arguments was a 500."""
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    history = [*CHAT_BODY["messages"], {"role": "assistant", "content": None, "tool_calls": [call]}]
    r = client.post(CHAT, json=CHAT_BODY | {"messages": history})
    assert r.status_code == 400 and "arguments" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("schema", [[1], {"a": 1}])
def test_regression_a_tool_schema_with_an_unhashable_dialect_is_a_400(client, schema):
    """jsonschema looks `$schema` up in a dict: a list or object there raised TypeError, a 500."""
    spec = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$schema": schema}}}
    r = client.post(CHAT, json=CHAT_BODY | {"tools": [spec]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]", r.text
