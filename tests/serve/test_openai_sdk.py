"""`agent-r1 serve` through the real `openai` SDK client: `n` (each answer its own seed), `tool_choice`
(`required` and a named function force the call, `none` hides the tools), `parallel_tool_calls`,
`response_format` and `n` streamed."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError

from agent_r1.env.tool_calls import CALL_CLOSE
from agent_r1.serve import create_app
from tests.conftest import TOOL_QUESTION
from tests.serve.test_app import CALCULATOR, NAME, model, served  # noqa: F401 - the fixtures

ASK = [{"role": "user", "content": TOOL_QUESTION}]


@pytest.fixture
async def sdk(served):  # noqa: F811
    transport = httpx.ASGITransport(app=create_app(served))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


async def test_n_answers_are_sampled_each_with_its_own_seed(sdk):
    question = [{"role": "user", "content": "Say something."}]
    ask = dict(model=NAME, messages=question, max_tokens=12, temperature=1.5, logprobs=True)
    three = await sdk.chat.completions.create(**ask, n=3, seed=11)
    assert [c.index for c in three.choices] == [0, 1, 2]
    again = await sdk.chat.completions.create(**ask, n=3, seed=11)
    answers = [c.message.content for c in three.choices]
    assert len(set(answers)) == 3  # one seed for all three would repeat one answer
    assert [c.message.content for c in again.choices] == answers  # seed + k: reproducible
    assert three.usage.completion_tokens == sum(len(c.logprobs.content) for c in three.choices)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "calculator"}}])
async def test_a_forcing_tool_choice_returns_the_call_the_model_makes_on_its_own(sdk, choice):
    own = (await sdk.chat.completions.create(model=NAME, messages=ASK, tools=CALCULATOR, temperature=0)).choices[0]
    forced = (
        await sdk.chat.completions.create(model=NAME, messages=ASK, tools=CALCULATOR, tool_choice=choice, temperature=0)
    ).choices[0]
    assert calls(own.message) and calls(forced.message) == calls(own.message)
    assert forced.finish_reason == "tool_calls" and not forced.message.content


async def test_tool_choice_none_hides_the_tools(sdk):
    reply = await sdk.chat.completions.create(
        model=NAME, messages=ASK, tools=CALCULATOR, tool_choice="none", temperature=0, max_tokens=24
    )
    assert not reply.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "the request lists no tools"),
        ({"tools": CALCULATOR, "tool_choice": {"type": "function", "function": {"name": "search"}}}, "tool_choice",
         "'search', which is not among the request's tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "response_format must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format", 'unsupported JSON schema: Unsupported type "nonsense"'),
        ({"n": 10_000}, "n", "max_batch_size"),
    ],
)  # fmt: skip
async def test_what_cannot_be_served_is_a_400_naming_it(sdk, extra, param, message):
    with pytest.raises(BadRequestError) as refused:
        await sdk.chat.completions.create(model=NAME, messages=ASK, **extra)
    assert refused.value.body["param"] == param and message in refused.value.body["message"]
    ok = await sdk.chat.completions.create(model=NAME, messages=ASK, response_format={"type": "text"}, max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop", "tool_calls")


async def test_parallel_tool_calls_lets_the_model_end_its_turn_itself(sdk, served, monkeypatch):  # noqa: F811
    stops, generate = [], served.engine.generate

    async def spy(prompts, params, *args, **kwargs):
        stops.append(params.stop)
        return await generate(prompts, params, *args, **kwargs)

    monkeypatch.setattr(served.engine, "generate", spy)
    for parallel in (None, False, True):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        await sdk.chat.completions.create(model=NAME, messages=ASK, tools=CALCULATOR, temperature=0, **extra)
    assert [CALL_CLOSE in s for s in stops] == [True, True, False]


async def test_n_streamed_gives_each_choice_its_own_chunks(sdk):
    """Greedy on the tool model's own question, where it calls the calculator: both choices stream their call,
    as the whole response has them. (Sampled answers are compared by structure only: a row's logits differ in
    their last bits with the rows it is batched with, and requests sent apart are batched apart.)"""
    whole = await sdk.chat.completions.create(model=NAME, messages=ASK, tools=CALCULATOR, n=2, temperature=0)
    stream = await sdk.chat.completions.create(
        model=NAME, messages=ASK, tools=CALCULATOR, n=2, temperature=0, stream=True
    )
    streamed: dict[int, list] = {0: [], 1: []}
    finishes = {}
    async for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += [(t.function.name, json.loads(t.function.arguments)) for t in c.delta.tool_calls or []]
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    assert streamed == {c.index: calls(c.message) for c in whole.choices} and streamed[0]
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    sampled = await sdk.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Say something."}], n=2, max_tokens=8, stream=True
    )
    texts: dict[int, str] = {}
    async for chunk in sampled:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1] and all(texts.values())


VERDICT = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["verdict", "confidence"],
}


async def test_response_format_json_schema_is_guaranteed_by_the_grammar(sdk):
    """The overfit tool model writes a tool call, never JSON, on its own; at temperature 1.5 under the grammar
    every answer is JSON the schema accepts, also streamed, also through the Responses API."""
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    question = [{"role": "user", "content": "Is 6 * 7 = 42? Answer as JSON."}]
    ask = dict(model=NAME, messages=question, max_tokens=60, temperature=1.5, seed=5, response_format=response_format)
    reply = await sdk.chat.completions.create(**ask, n=3)
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), VERDICT)
    stream = await sdk.chat.completions.create(**ask, stream=True)
    streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert streamed == reply.choices[0].message.content  # choice 0 has the same seed
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}}
    answer = await sdk.responses.create(model=NAME, input=question[0]["content"], text=text, temperature=1.5)
    jsonschema.validate(json.loads(answer.output_text), VERDICT)
