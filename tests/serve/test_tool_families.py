"""`agent-r1 serve` (and the gateway, which shares agent_r1.api.messages) for models of every tool-call
family: the request rendered by the model's own template with its tools, the answer's calls read in the
family's syntax into OpenAI `tool_calls`, and a forced call opened as the family writes one."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from agent_r1.api.messages import chat_result, forced_call, template_messages
from agent_r1.api.schema import ChatMessage
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_formats import TOOL_FORMATS
from agent_r1.serve import ServedModel, create_app
from tests.conftest import make_tiny_llama
from tests.env.test_tool_formats import FAMILIES, templated

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "abcdefghi", "type": "function",
     "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'}}]},
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "42"},
]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversation_is_rendered_by_the_models_own_template(tokenizer, family):
    tok = templated(tokenizer, family)
    fmt = ChatFormat(tok)
    messages = template_messages([ChatMessage.model_validate(m) for m in HISTORY], [CALC], fmt)
    prompt = tok.decode(fmt.with_tools([CALC]).initial(messages))
    expected = [
        HISTORY[0], HISTORY[1],
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "abcdefghi",
         "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "abcdefghi", "name": "calculator"},
    ]  # fmt: skip
    assert prompt == tok.apply_chat_template(expected, tools=[CALC], add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_answers_call_becomes_openai_tool_calls_and_its_prose_the_content(family):
    calls = TOOL_FORMATS[family]
    text = calls.write_turn("Let me compute.", [("calculator", {"expression": "6 * 7"})])
    content, tool_calls, finish = chat_result(text, (), [CALC], "stop", calls)
    assert finish == "tool_calls" and [c["function"]["name"] for c in tool_calls] == ["calculator"]
    assert json.loads(tool_calls[0]["function"]["arguments"]) == {"expression": "6 * 7"}
    # Llama 3 writes the call alone and harmony's prose is its analysis channel: neither is content
    if family in ("llama3_json", "harmony"):
        assert content is None
    else:
        assert content.rstrip("\n") == "Let me compute."
    answer = "<|channel|>final<|message|>42<|return|>" if family == "harmony" else "It is 42."
    assert chat_result(answer, (), [CALC], "stop", calls) == ("42" if family == "harmony" else answer, [], "stop")


@pytest.mark.parametrize("family", sorted(TOOL_FORMATS))
def test_a_forced_call_opens_as_the_family_writes_one(family):
    calls = TOOL_FORMATS[family]
    named = forced_call({"type": "function", "function": {"name": "calculator"}}, [CALC], calls)
    written = calls.format_call("calculator", {"expression": "6 * 7"})
    assert written.startswith(named) and written.startswith(forced_call("required", [CALC], calls))
    finished = chat_result(written, (), [CALC], "stop", calls)[1]  # the policy samples on from the opening
    assert [c["function"]["name"] for c in finished] == ["calculator"]


def test_the_server_prompts_a_harmony_model_with_its_own_template(tokenizer):
    """The whole request path: the prompt the engine is given is the template's rendering with the tools."""
    tok = templated(tokenizer, "harmony")
    engine = LocalEngine(make_tiny_llama(len(tok), hidden=32), tok, max_context=2048, seed=0)
    prompts = []
    generate = engine.generate

    async def spy(rows, params, *args, **kwargs):
        prompts.extend(rows)
        return await generate(rows, params, *args, **kwargs)

    engine.generate = spy
    served = ServedModel(engine, tok, ChatFormat(tok), "m", engine.eos_ids, request_timeout=60.0)

    async def ask():
        transport = httpx.ASGITransport(app=create_app(served))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": "m", "messages": HISTORY, "tools": [CALC], "max_tokens": 4}
            return await client.post("/v1/chat/completions", json=body)

    response = asyncio.run(ask())
    assert response.status_code == 200, response.text
    rendered = tok.decode(prompts[0])
    assert "type calculator = (_:" in rendered and rendered.endswith("<|end|><|start|>assistant")
    assert "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>42<|end|>" in rendered
