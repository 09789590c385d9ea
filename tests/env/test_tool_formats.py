"""Tool-call formats per model family: read off the chat template, rendered by it, parsed back.

The templates in tests/env/templates write each family's syntax. For every family, the calls a template
renders parse back to the same calls, and an episode's context (prompt + sampled call + the env's
continuation) is exactly what the template renders for the same conversation written with structured
`tool_calls` and `tool` messages.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest

from agent_r1.config import load_config
from agent_r1.env.prompt_format import ChatFormat, prompt_format_for
from agent_r1.env.tool_calls import ParsedCall, ParseError
from agent_r1.env.tool_env import ToolEnv
from agent_r1.env.tool_formats import TOOL_FORMATS, detect_tool_format, tool_format
from agent_r1.tools import calculator, tool
from agent_r1.trainer.config import TrainConfig
from agent_r1.types import Action

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = ["hermes", "llama3_json", "mistral_args", "qwen3_coder", "harmony"]


@tool
def forecast(city: str, days: int, units: list[str]) -> str:
    """Weather for a city.

    Args:
        city: the city
        days: how many days ahead
        units: the units to report in
    """
    return f"{city}: sunny for {days} days ({', '.join(units)})"


TOOLS = {"calculator": calculator, "forecast": forecast}


def templated(tokenizer, family: str):
    """The real tokenizer with a family's chat template."""
    tok = copy.copy(tokenizer)
    tok.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return tok


def structured(name: str, args: dict) -> dict:
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def render(tok, messages, tools=None, generation_prompt=False) -> str:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def test_each_family_is_read_off_its_template(tokenizer):
    assert [detect_tool_format((TEMPLATES / f"{f}.jinja").read_text()) for f in FAMILIES] == FAMILIES
    assert detect_tool_format(tokenizer.chat_template) == "hermes"  # SmolLM2's ChatML template: ours
    assert detect_tool_format(None) == "hermes"
    assert detect_tool_format("{{ '[TOOL_CALLS] [' }}{{ tool_calls | tojson }}") == "mistral"  # v3: a JSON list


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("name", "args"),
    [("calculator", {"expression": "6 * 7"}), ("forecast", {"city": "Paris </x>", "days": 3, "units": ["C", "mm"]})],
)
def test_a_call_the_template_renders_parses_back_to_the_same_call(tokenizer, family, name, args):
    tok = templated(tokenizer, family)
    user = [{"role": "user", "content": "hi"}]
    schemas = [t.schema for t in TOOLS.values()]
    before = render(tok, user, schemas, generation_prompt=True)
    after = render(tok, [*user, structured(name, args)], schemas)
    assert after.startswith(before)
    turn = after[len(before) :].split(tok.eos_token)[0]  # the assistant turn as sampled (the EOS is no text)
    fmt = tool_format(tok.chat_template)
    assert fmt.parse(turn, {n: t.schema for n, t in TOOLS.items()}) == [ParsedCall(name, args)]
    assert fmt.format_call(name, args).replace("<\\/", "</") in turn.replace("<\\/", "</")  # what the template writes


@pytest.mark.parametrize("version", ["v3", "v7"])
def test_mistrals_own_encoder_writes_calls_the_mistral_parser_reads(version):
    """mistral_common is Mistral's reference encoder: its rendering of an assistant tool call."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.tool_calls import FunctionCall, ToolCall
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    encoder = getattr(MistralTokenizer, version)()
    calls = [ToolCall(id="abcdefghi", function=FunctionCall(name="forecast", arguments='{"city": "Oslo", "days": 2}'))]
    result = ToolMessage(content="sunny", tool_call_id="abcdefghi")
    messages = [UserMessage(content="weather?"), AssistantMessage(tool_calls=calls), result]
    request = ChatCompletionRequest(messages=messages)
    ids = encoder.encode_chat_completion(request).tokens
    text = encoder.instruct_tokenizer.tokenizer.decode(ids, special_token_policy=SpecialTokenPolicy.KEEP)
    turn = text.split("[/INST]", 1)[1].split("</s>", 1)[0].replace("\u2581", " ")  # sentencepiece's word marks
    assert turn.startswith("[TOOL_CALLS]")
    assert TOOL_FORMATS["mistral"].parse(turn) == [ParsedCall("forecast", {"city": "Oslo", "days": 2})]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_episodes_context_is_what_the_template_renders_for_the_conversation(tokenizer, family):
    tok = templated(tokenizer, family)
    env = ToolEnv(TOOLS, ChatFormat(tok), instructions="Use the tools.")
    assert env.calls.name == family and env.native
    first = asyncio.run(env.reset({"question": "What is 6 * 7?"}))
    text = env.calls.format_call("calculator", {"expression": "6 * 7"})
    ids = tok.encode(text, add_special_tokens=False)
    result = asyncio.run(env.step(Action(ids, [0.0] * len(ids), text)))
    assert result.info["tool_calls"] == 1 and result.info["format_errors"] == 0 and not result.done
    schemas = [t.schema for t in TOOLS.values()]
    conversation = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 6 * 7?"},
        structured("calculator", {"expression": "6 * 7"}),
        {"role": "tool", "name": "calculator", "tool_call_id": "c00010000", "content": "42"},
    ]
    expected = render(tok, conversation, schemas, generation_prompt=family != "mistral_args")
    assert tok.decode(result.observation.token_ids) == expected.replace("<\\/", "</")
    assert result.observation.token_ids[: len(first.token_ids)] == first.token_ids  # the prompt, unchanged
    assert "forecast" in tok.decode(first.token_ids)  # the tools, rendered by the template


def test_a_template_without_tools_gets_our_system_prompt_in_the_family_asked_for(tokenizer):
    """SmolLM2's template renders no tools: the system prompt lists them, with an example of the call
    syntax asked for (`tool_format=...`), and the results come back as <tool_response> user turns."""
    fmt = prompt_format_for(tokenizer, True, "llama3_json")
    env = ToolEnv(TOOLS, fmt)
    assert env.calls.name == "llama3_json" and not env.native
    assert '{"name": "tool_name", "parameters": {"argument": "value"}}' in env.system
    assert "<tool_call>" not in env.system
    assert ToolEnv(TOOLS, prompt_format_for(tokenizer, True)).stop[0] == "</tool_call>"  # hermes, as before


def test_an_unknown_tool_format_is_one_line_naming_the_valid_ones(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="unknown tool_format 'qwen': use auto or one of hermes, llama3_json") as e:
        prompt_format_for(tokenizer, True, "qwen")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="tool_format") as e:
        load_config(TrainConfig, None, ["tool_format=qwen"])
    assert "\n" not in str(e.value)
    assert load_config(TrainConfig, None, ["tool_format=harmony"]).tool_format == "harmony"


@pytest.mark.parametrize(
    ("family", "text", "expected"),
    [
        ("llama3_json", "The answer is 42.", []),
        (
            "llama3_json",
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
            [ParsedCall("a", {"x": 1}), ParsedCall("b", {})],
        ),
        ("llama3_json", '{"name": "a", "parameters": {"x": 1}', "not valid JSON"),
        ("llama3_json", '{"parameters": {}}', "must be a JSON object like"),
        ("llama3_json", '{"name": "a", "parameters": {}} and then prose', "text after a tool call"),
        ("mistral", "no call here", []),
        (
            "mistral",
            'ok [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
            [ParsedCall("a", {"x": 1}), ParsedCall("b", {})],
        ),
        ("mistral", "[TOOL_CALLS] [{oops", "not valid JSON"),
        (
            "mistral_args",
            '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]123456789[ARGS]{}',
            [ParsedCall("a", {"x": 1}), ParsedCall("b", {})],
        ),
        ("mistral_args", "[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b", "a Mistral tool call is"),
        ("mistral_args", "[TOOL_CALLS][ARGS]{}", "needs a name"),
        (
            "qwen3_coder",
            "<tool_call>\n<function=forecast>\n<parameter=days>\n3\n</parameter>\n</function>",
            [ParsedCall("forecast", {"days": 3})],
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=forecast>\n<parameter=days>\nthree\n</parameter>\n</function>",
            [ParsedCall("forecast", {"days": "three"})],
        ),  # the argument check reports it
        ("qwen3_coder", "<tool_call>\n<function=forecast>\n<parameter=city>\nOslo", "unclosed <function=...>"),
        ("harmony", "<|channel|>final<|message|>42<|return|>", []),
        (
            "harmony",
            "<|channel|>analysis<|message|>use it to=x<|end|><|start|>assistant to=functions.a<|channel|>"
            'commentary json<|message|>{"x": 1}<|call|>',
            [ParsedCall("a", {"x": 1})],
        ),
        ("harmony", "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{x<|call|>", "not valid JSON"),
    ],
)
def test_each_parser_reads_calls_answers_and_mistakes(family, text, expected):
    got = TOOL_FORMATS[family].parse(text, {"forecast": forecast.schema})
    if isinstance(expected, str):
        assert len(got) >= 1 and isinstance(got[-1], ParseError) and expected in got[-1].message
        assert "\n" not in got[-1].message
    else:
        assert got == expected


def test_qwen3_coder_arguments_must_be_an_object():
    with pytest.raises(ValueError, match="qwen3_coder tool calls take an object of arguments, got str"):
        TOOL_FORMATS["qwen3_coder"].format_call("a", json.dumps({"x": 1}))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_demonstration_trains_the_calls_in_the_models_own_syntax(tokenizer, family):
    """Tasks write demonstrations with hermes calls and <tool_response> turns; SFT lays them out in the
    model's family: the row is the template's rendering of the conversation, and the loss covers the
    call turn (and its EOS where the family ends a call with one) and the answer."""
    from agent_r1.tasks.calculator import demo
    from agent_r1.trainer.sft import demo_to_sequence

    tok = templated(tokenizer, family)
    env = ToolEnv(TOOLS, ChatFormat(tok), instructions="Use the tools.")
    written = demo({"question": "What is 6 * 7?", "solution": "6 * 7"})
    row = demo_to_sequence(env.in_model_format(written), env.prompt_prefix, env.format, tok)
    conversation = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 6 * 7?"},
        structured("calculator", {"expression": "6 * 7"}),
        {"role": "tool", "name": "calculator", "tool_call_id": "c00020000", "content": "42"},
    ]
    schemas = [t.schema for t in TOOLS.values()]
    expected = render(tok, conversation, schemas, generation_prompt=True) + "<answer>42</answer>" + tok.eos_token
    assert tok.decode(row.input_ids) == expected.replace("<\\/", "</")
    trained = tok.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m])
    call = env.calls.format_call("calculator", {"expression": "6 * 7"})
    ends_with_eos = not env.calls.stop
    assert trained == call + tok.eos_token * ends_with_eos + "<answer>42</answer>" + tok.eos_token


def test_hermes_demonstrations_for_a_template_without_tools_are_left_as_written(tokenizer):
    from agent_r1.tasks.calculator import demo

    env = ToolEnv(TOOLS, ChatFormat(tokenizer))
    written = demo({"question": "What is 6 * 7?", "solution": "6 * 7"})
    assert env.in_model_format(written) == written


def test_a_policy_is_served_in_the_tool_format_it_was_trained_with(tmp_path):
    """agent_r1.json records the family (`tool_format=` of training, or the template's); chat, serve and
    eval read it back for "auto", and a `tool_format=` given to them wins."""
    from agent_r1.task import resolve_tool_format
    from agent_r1.trainer.export import policy_info

    info = policy_info("default", True, None, TOOL_FORMATS["llama3_json"])
    call = '{"name": "tool_name", "parameters": {"argument": "value"}}'
    assert info["tool_call_format"] == {"name": "llama3_json", "call": call, "stop": []}
    (tmp_path / "agent_r1.json").write_text(json.dumps(info))
    assert resolve_tool_format("auto", str(tmp_path)) == "llama3_json"
    assert resolve_tool_format("harmony", str(tmp_path)) == "harmony"
    assert resolve_tool_format("auto", str(tmp_path / "a-hub-model")) == "auto"  # the template decides
