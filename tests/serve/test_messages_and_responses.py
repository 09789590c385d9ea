"""`agent-r1 serve`'s Anthropic Messages and OpenAI Responses endpoints, driven through the real `anthropic` and
`openai` SDKs: the tiny tool model calls the calculator and answers after its result, as it does over chat
completions, the follow-up prompt is token for token the one ToolEnv builds, streams accumulate to the whole
answer, and bad input is each protocol's own 4xx."""

from __future__ import annotations

import httpx
import httpx2
import pytest
from anthropic import AsyncAnthropic
from anthropic import BadRequestError as AnthropicBadRequest
from anthropic import NotFoundError as AnthropicNotFound
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from agent_r1.serve import create_app
from agent_r1.tools import calculator
from tests.conftest import TOOL_ANSWER, TOOL_QUESTION
from tests.serve.test_app import NAME, model, served  # noqa: F401 - the fixtures

F = calculator.schema["function"]
ANTHROPIC_TOOLS = [{"name": F["name"], "description": F["description"], "input_schema": F["parameters"]}]
RESPONSES_TOOLS = [
    {"type": "function", "name": F["name"], "description": F["description"], "parameters": F["parameters"]}
]
ASK = [{"role": "user", "content": TOOL_QUESTION}]
GREEDY = {"temperature": 0}  # the anthropic SDK no longer has sampling arguments; the API still reads them


@pytest.fixture
async def http(served):  # noqa: F811
    transport = httpx.ASGITransport(app=create_app(served))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.fixture
async def claude(served):  # noqa: F811 - the anthropic SDK is built on httpx2, a fork of httpx
    transport = httpx2.ASGITransport(app=create_app(served))
    async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
        yield AsyncAnthropic(base_url="http://test", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture
def openai(http):
    return AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


def tool_turn_tokens(served) -> int:  # noqa: F811
    """The tokens the template adds for one tool result of "42" after a call, as ToolEnv renders it."""
    turn = [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}]
    return len(served.prompt_format.continuation(turn, False))


# --- Anthropic Messages ----------------------------------------------------------------------------------------
async def test_messages_tool_use_round_trip_is_token_exact(claude, served):  # noqa: F811
    ask = dict(model=NAME, max_tokens=64, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    first = await claude.messages.create(messages=ASK, **ask)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("calculator", {"expression": "6 * 7"}) and use.id.startswith("toolu_")
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]}, result]
    second = await claude.messages.create(messages=history, **ask)
    assert [b.text for b in second.content] == [TOOL_ANSWER] and second.stop_reason == "end_turn"
    # the follow-up prompt is the first prompt + the sampled call + ToolEnv's tool turn, nothing re-rendered
    extended = first.usage.input_tokens + first.usage.output_tokens + tool_turn_tokens(served)
    assert second.usage.input_tokens == extended
    counted = await claude.messages.count_tokens(model=NAME, messages=history, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == second.usage.input_tokens


async def test_messages_stream_accumulates_to_the_whole_message(claude):
    ask = dict(model=NAME, max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    whole = await claude.messages.create(**ask)
    async with claude.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content] == [(b.name, b.input) for b in whole.content]
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == whole.usage.output_tokens
    plain = dict(model=NAME, max_tokens=12, messages=[{"role": "user", "content": "Say something."}], extra_body=GREEDY)
    async with claude.messages.stream(**plain) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert (
        len(pieces) > 1
        and "".join(pieces) == final.content[0].text == (await claude.messages.create(**plain)).content[0].text
    )
    assert final.stop_reason == "max_tokens" and final.usage.input_tokens > 0


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "calculator"}])
async def test_messages_tool_choice_forces_the_call(claude, choice):
    ask = dict(model=NAME, max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    forced = await claude.messages.create(**ask, tool_choice=choice)
    assert forced.stop_reason == "tool_use" and forced.content[-1].input == {"expression": "6 * 7"}
    hidden = await claude.messages.create(**ask, tool_choice={"type": "none"})
    assert all(b.type == "text" for b in hidden.content)


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({"max_tokens": 0}, AnthropicBadRequest, "max_tokens"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, AnthropicBadRequest, "tools[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, AnthropicBadRequest,
         "messages[0].content[0]"),
        ({"tool_choice": {"type": "tool"}}, AnthropicBadRequest, "tool_choice"),
        ({"model": "claude-sonnet-4-5"}, AnthropicNotFound, "claude-sonnet-4-5"),
    ],
)  # fmt: skip
async def test_bad_messages_requests_get_anthropic_error_bodies(claude, extra, error, message):
    ask = dict(model=NAME, max_tokens=8, messages=ASK, tools=ANTHROPIC_TOOLS)
    with pytest.raises(error) as refused:
        await claude.messages.create(**(ask | extra))
    body = refused.value.body
    assert body["type"] == "error" and message in body["error"]["message"]
    assert body["error"]["type"] == ("not_found_error" if error is AnthropicNotFound else "invalid_request_error")
    assert (await claude.messages.create(**ask)).stop_reason in ("tool_use", "max_tokens", "end_turn")


# --- OpenAI Responses ------------------------------------------------------------------------------------------
async def test_responses_function_call_round_trip_through_previous_response_id(openai, served):  # noqa: F811
    first = await openai.responses.create(model=NAME, input=TOOL_QUESTION, tools=RESPONSES_TOOLS, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "calculator" and first.status == "completed"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "42"}
    second = await openai.responses.create(
        model=NAME, previous_response_id=first.id, input=[output], tools=RESPONSES_TOOLS, temperature=0
    )
    assert second.output_text == TOOL_ANSWER
    extended = first.usage.input_tokens + first.usage.output_tokens + tool_turn_tokens(served)
    assert second.usage.input_tokens == extended
    # the same conversation sent back as items (store=false clients do this) is the same prompt
    items = [*ASK, *[o.model_dump() for o in first.output], output]
    again = await openai.responses.create(model=NAME, input=items, tools=RESPONSES_TOOLS, temperature=0, store=False)
    assert again.output_text == TOOL_ANSWER and again.usage.input_tokens == extended
    with pytest.raises(NotFoundError) as unknown:  # store=false: nothing to continue from
        await openai.responses.create(model=NAME, previous_response_id=again.id, input="and?")
    assert again.id in unknown.value.body["message"] and unknown.value.body["param"] == "previous_response_id"


async def test_responses_stream_accumulates_to_the_whole_response(openai):
    ask = dict(model=NAME, input=TOOL_QUESTION, tools=RESPONSES_TOOLS, temperature=0)
    whole = await openai.responses.create(**ask)
    async with openai.responses.stream(**ask) as stream:
        streamed = await stream.get_final_response()
    assert [(o.name, o.arguments) for o in streamed.output] == [(o.name, o.arguments) for o in whole.output]
    plain = dict(model=NAME, input="Say something.", max_output_tokens=12, temperature=0)
    events = [e async for e in await openai.responses.create(**plain, stream=True)]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # cut at max_output_tokens, the stream ends as OpenAI's does: response.incomplete (which the SDK's
    # responses.stream() helper does not accept as an end, hence the raw stream here)
    assert [e.sequence_number for e in events] == list(range(len(events))) and events[-1].type == "response.incomplete"
    final = events[-1].response
    assert (
        len(deltas) > 1 and "".join(deltas) == final.output_text == (await openai.responses.create(**plain)).output_text
    )
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    follow = await openai.responses.create(
        model=NAME, previous_response_id=final.id, input="Go on.", max_output_tokens=2
    )
    assert follow.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens  # the stream was stored


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0]"),
        ({"text": {"format": {"type": "xml"}}}, "response_format"),
    ],
)
async def test_bad_responses_requests_are_openai_style_400s(openai, extra, param):
    with pytest.raises(BadRequestError) as refused:
        await openai.responses.create(**({"model": NAME, "input": "hi", "max_output_tokens": 2} | extra))
    assert refused.value.body["param"] == param
