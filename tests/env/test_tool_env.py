"""ToolEnv: every way a model or a tool can misbehave becomes an observation and a counted metric."""

import asyncio
import time

import pytest

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import extract_answer
from agent_r1.env.tool_env import ToolEnv
from agent_r1.tools import ToolResult, calculator, echo, tool
from agent_r1.types import Action, Termination
from tests.conftest import picture


@tool(timeout=0.2)
def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


@tool
def boom(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("kaboom")


@tool(max_output_chars=100)
def flood(n: int) -> str:
    """Return n characters.

    Args:
        n: how many
    """
    return "y" * n


@tool
def scored(x: int) -> ToolResult:
    """Return x with a process reward.

    Args:
        x: value
    """
    return ToolResult(str(x), reward=0.25)


TOOLS = {t.name: t for t in (calculator, echo, sleepy, boom, flood, scored)}


def action(tokenizer, text, finish="stop"):
    ids = tokenizer.encode(text)
    return Action(ids, [-1.0] * len(ids), text, finish)


def call(name, args):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


async def one_step(tokenizer, text, **kw):
    env = ToolEnv(TOOLS, ChatFormat(tokenizer), lambda task, text: float(extract_answer(text) == "7"), **kw)
    first = await env.reset({"question": "q"})
    result = await env.step(action(tokenizer, text))
    return env, first, result


@pytest.mark.parametrize(
    ("text", "kind", "shown"),
    [
        ("<tool_call>{not json}</tool_call>", "parse_error", "Error: tool call is not valid JSON"),
        (call("nope", {}), "unknown_tool", "Error: unknown tool 'nope'"),
        (call("calculator", {"expr": "1"}), "invalid_arguments", "Error: invalid arguments for calculator"),
        (call("calculator", {}), "invalid_arguments", "Error: invalid arguments for calculator"),
        (
            call("calculator", {"expression": 5}),
            "invalid_arguments",
            "Error: invalid arguments for calculator",
        ),
        (call("boom", {"x": 1}), "exception", "Error: boom raised RuntimeError: kaboom"),
        (call("sleepy", {"seconds": 3}), "timeout", "Error: tool sleepy timed out"),
        (call("calculator", {"expression": "9**9**9"}), "exception", "Error: calculator raised ValueError"),
    ],
)
async def test_failures_become_observations_and_metrics(tokenizer, text, kind, shown):
    start = time.perf_counter()
    _env, _, (obs, reward, done, info) = await one_step(tokenizer, text)
    assert time.perf_counter() - start < 2.0
    assert not done and reward is None
    assert info["tool_errors"] == {kind: 1}
    assert info["format_errors"] == (kind == "parse_error")
    new_text = tokenizer.decode(obs.token_ids)
    assert shown in new_text.split("<tool_response>")[-1]


async def test_huge_output_is_truncated_and_counted(tokenizer):
    _env, _, (obs, _, done, info) = await one_step(tokenizer, call("flood", {"n": 5_000_000}))
    assert not done and info["truncated_outputs"] == 1 and info["tool_errors"] == {}
    assert len(info["tool_results"][0]["output"]) < 200
    assert len(obs.token_ids) < 1000


async def test_calls_run_concurrently_and_context_is_appended(tokenizer):
    text = (
        call("sleepy", {"seconds": 0.1}) + call("sleepy", {"seconds": 0.1}) + call("calculator", {"expression": "3+4"})
    )
    start = time.perf_counter()
    _env, first, (obs, _, _done, info) = await one_step(tokenizer, text)
    assert time.perf_counter() - start < 0.19  # two 0.1 s calls overlapped
    assert info["tool_calls"] == 3 and info["tool_errors"] == {}
    sampled = tokenizer.encode(text)
    assert obs.token_ids[: len(first.token_ids) + len(sampled)] == first.token_ids + sampled
    assert tokenizer.decode(obs.token_ids).endswith(
        "<tool_response>\nwoke\n</tool_response>\n<tool_response>\nwoke\n</tool_response>\n"
        "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


async def test_answer_ends_the_episode_with_the_outcome_reward(tokenizer):
    _, _, (obs, reward, done, info) = await one_step(tokenizer, "It is <answer>7</answer>")
    assert done and obs is None and reward == 1.0 and info["termination"] == Termination.ANSWERED
    _, _, (_, reward, done, _) = await one_step(tokenizer, "I think 8.")  # no tool call = an answer
    assert done and reward == 0.0


async def test_process_rewards_and_max_turns(tokenizer):
    env = ToolEnv(TOOLS, ChatFormat(tokenizer), max_turns=2)
    await env.reset({"question": "q"})
    _, reward, done, _ = await env.step(action(tokenizer, call("scored", {"x": 1}) + call("scored", {"x": 2})))
    assert reward == 0.5 and not done
    _, reward, done, info = await env.step(action(tokenizer, call("scored", {"x": 3})))
    assert done and info["termination"] == Termination.MAX_TURNS


async def test_rewrite_replaces_the_context(tokenizer):
    def keep_last_exchange(messages):
        return [messages[0], messages[-1]]  # system + latest tool results only

    _env, _first, (obs, _, _, _) = await one_step(tokenizer, call("echo", {"text": "zz"}), rewrite=keep_last_exchange)
    text = tokenizer.decode(obs.token_ids)
    assert "<tool_response>\nzz\n</tool_response>" in text and '"arguments": {"text": "zz"}' not in text


def test_bad_max_turns():
    with pytest.raises(ValueError, match="max_turns"):
        ToolEnv(TOOLS, None, max_turns=0)


async def test_hung_tool_does_not_block_the_event_loop(tokenizer):
    ticks = 0

    async def ticker():
        nonlocal ticks
        for _ in range(10):
            await asyncio.sleep(0.01)
            ticks += 1

    await asyncio.gather(one_step(tokenizer, call("sleepy", {"seconds": 0.5})), ticker())
    assert ticks == 10


async def test_base_model_writing_the_next_user_turn_ends_the_episode(tokenizer):
    from agent_r1.env.prompt_format import TextFormat

    env = ToolEnv(TOOLS, TextFormat(tokenizer), lambda task, text: float(text.strip() == "<tool_call>{bad"))
    await env.reset({"question": "q"})
    _, reward, done, info = await env.step(action(tokenizer, "<tool_call>{bad\nUser:"))
    assert done and info["termination"] == Termination.ANSWERED
    assert reward == 1.0  # the reward sees the response without the stop string


async def test_tool_output_is_cut_by_tokens(tokenizer):
    text = call("echo", {"text": "word " * 300})
    _env, first, (obs, _, _, info) = await one_step(tokenizer, text, max_tool_tokens=12)
    assert info["truncated_outputs"] == 1
    sampled = len(tokenizer.encode(text))
    new = tokenizer.decode(obs.token_ids[len(first.token_ids) + sampled :])
    shown = new.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert shown.endswith(" ...[truncated]")
    assert len(tokenizer.encode(shown.removesuffix(" ...[truncated]"), add_special_tokens=False)) == 12
    _env, _, (_, _, _, info) = await one_step(tokenizer, call("echo", {"text": "short"}), max_tool_tokens=12)
    assert info["truncated_outputs"] == 0


async def test_episode_reward_sees_every_response(tokenizer):
    seen = []
    env = ToolEnv(TOOLS, ChatFormat(tokenizer), lambda task, rs: seen.append(rs) or 1.0, reward_on="episode")
    await env.reset({"question": "q"})
    first = call("calculator", {"expression": "3+4"})
    await env.step(action(tokenizer, first))
    await env.step(action(tokenizer, "<answer>7</answer>"))
    assert seen == [[first, "<answer>7</answer>"]]
    with pytest.raises(ValueError, match="max_tool_tokens must be >= 1"):
        ToolEnv(TOOLS, ChatFormat(tokenizer), max_tool_tokens=0)


async def test_potential_turns_tool_results_into_process_rewards(tokenizer):
    """Phi = how many distinct echo outputs were "found" so far (/ 2): a turn earns the rise it caused,
    on top of what the tools themselves gave."""

    def found(task, results):
        assert task == {"question": "q"}
        return len({r["output"] for r in results if r["name"] == "echo"} & {"a", "b"}) / 2

    env = ToolEnv(TOOLS, ChatFormat(tokenizer), potential=found, max_turns=5)
    await env.reset({"question": "q"})
    _, r1, _, _ = await env.step(action(tokenizer, call("echo", {"text": "a"}) + call("scored", {"x": 1})))
    _, r2, _, _ = await env.step(action(tokenizer, call("echo", {"text": "a"})))  # nothing new
    _, r3, _, _ = await env.step(action(tokenizer, call("echo", {"text": "b"})))
    assert (r1, r2, r3) == (0.5 + 0.25, 0.0, 0.5)
    assert [r["output"] for r in env.tool_results] == ["a", "1", "a", "b"]


async def test_call_error_reward_charges_the_models_mistakes_not_the_tools(tokenizer):
    """-0.3 per call the model got wrong (bad arguments, unknown tool, malformed JSON); a tool that
    raises is not the model's mistake, and a clean call earns nothing extra."""
    env = ToolEnv(TOOLS, ChatFormat(tokenizer), call_error_reward=-0.3, max_turns=6)
    await env.reset({"question": "q"})
    turns = [
        call("echo", {"query": "a"}),  # invalid_arguments
        call("nope", {}) + call("echo", {"text": 1}),  # unknown_tool + invalid_arguments
        "<tool_call>{not json</tool_call>",  # parse_error
        call("boom", {"x": 1}),  # exception: the tool's failure
        call("echo", {"text": "a"}),
    ]
    rewards = [(await env.step(action(tokenizer, t)))[1] for t in turns]
    assert rewards == pytest.approx([-0.3, -0.6, -0.3, None, None])
    env = ToolEnv(TOOLS, ChatFormat(tokenizer), max_turns=3)  # off by default
    await env.reset({"question": "q"})
    assert (await env.step(action(tokenizer, call("echo", {"query": "a"}))))[1] is None


async def test_state_is_what_the_tools_showed_not_what_the_agent_wrote(tokenizer):
    async def states(*texts):
        env = ToolEnv(TOOLS, ChatFormat(tokenizer), max_turns=5)
        out = [(await env.reset({"question": "q"})).state]
        for text in texts:
            obs, *_ = await env.step(action(tokenizer, text))
            out.append(obs.state)
        return out

    a = await states("<think>hm</think>" + call("echo", {"text": "x"}))
    b = await states("<think>other words</think>\n" + call("echo", {"text": "x"}))
    c = await states(call("echo", {"text": "y"}))
    assert a == b and a[0] == c[0] and a[1] != c[1]
    assert a[0] != a[1]


@tool
def look(what: str) -> ToolResult:
    """Show pictures.

    Args:
        what: "one", "two", "broken" or "many"
    """
    images = {
        "one": [picture(1)],
        "two": [picture(2), picture(3)],
        "broken": [b"not an image"],
        "many": [picture(4)] * 5,
    }
    return ToolResult(f"showing {what}", images=images[what])


async def test_tool_images_enter_the_context_once_with_the_placeholders(tiny_llava):
    """A tool's images go inside its response; the observation lists every image of the context in
    placeholder order. A broken image or one past max_images is a note the model reads, and counted."""
    from agent_r1.env.prompt_format import prompt_format_for

    fmt = prompt_format_for(tiny_llava[1])
    token = fmt.encoder.image_token_id
    env = ToolEnv({"look": look}, fmt, max_turns=6, max_images=4)
    tok = fmt.tokenizer
    obs = await env.reset({"messages": [{"role": "user", "content": [{"type": "image", "image": picture(0)}]}]})
    assert len(obs.images) == 1 and obs.token_ids.count(token) == 4
    obs, _, _, info = await env.step(action(tok, call("look", {"what": "two"})))
    assert [i.digest for i in obs.images[1:]] == [fmt.encoder.encode(picture(s)).digest for s in (2, 3)]
    assert obs.token_ids.count(token) == 12 and info["tool_results"][0]["images"] == 2
    shown = "<tool_response>\nshowing two\n" + "<image>" * 4 + "\n" + "<image>" * 4 + "\n</tool_response>"
    assert shown in tok.decode(obs.token_ids[-40:])
    obs, _, _, info = await env.step(action(tok, call("look", {"what": "broken"})))
    assert info["tool_errors"] == {"bad_image": 1} and len(obs.images) == 3
    assert "cannot be shown: cannot read image bytes" in tok.decode(obs.token_ids[-60:])
    obs, _, _, info = await env.step(action(tok, call("look", {"what": "many"})))
    assert info["tool_errors"] == {"too_many_images": 4} and len(obs.images) == 4
    assert obs.token_ids.count(token) == 16


async def test_a_text_only_model_is_told_where_a_tool_image_was(tokenizer):
    from agent_r1.env.prompt_format import NO_VISION

    env = ToolEnv({"look": look}, ChatFormat(tokenizer), max_turns=3)
    await env.reset({"question": "q"})
    obs, _, _, info = await env.step(action(tokenizer, call("look", {"what": "one"})))
    assert NO_VISION in tokenizer.decode(obs.token_ids) and obs.images == [] and info["tool_errors"] == {}
