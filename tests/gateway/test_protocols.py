"""Agent programs that speak Anthropic Messages or OpenAI Responses (tests/gateway/protocol_agents.py, the real
SDKs, run as commands) are trained as chat ones are: the first request renders exactly as ToolEnv renders the
same question and tool, every later step extends the one before token for token (one merged row, the engine's
sampled ids), streamed or not, continued by `previous_response_id` or by items."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import format_tool_responses
from agent_r1.env.tool_env import ToolEnv
from agent_r1.gateway import ProgramEnv, ProgramEnvFactory
from agent_r1.gateway.server import gateway
from agent_r1.rollout.agent_loop import summarize
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.tools import calculator
from agent_r1.types import Termination
from tests.conftest import TOOL_ANSWER, TOOL_QUESTION
from tests.gateway.test_env import TASK, answer_reward, rollout, tool_model  # noqa: F401 - the fixture

AGENT = (sys.executable, "-m", "tests.gateway.protocol_agents")


@pytest.mark.parametrize(
    "flags",
    [("messages",), ("messages", "--stream"), ("responses",), ("responses", "--stream"), ("responses", "--items")],
    ids=lambda f: "-".join(f),
)
def test_a_messages_or_responses_agent_is_one_token_exact_row(tool_model, tokenizer, flags):  # noqa: F811
    factory = ProgramEnvFactory(tokenizer, command=(*AGENT, *flags), reward=answer_reward)
    (traj,) = rollout(tool_model, tokenizer, factory)
    assert traj.termination == Termination.ANSWERED, traj.error
    first, second = traj.steps
    env = ToolEnv({"calculator": calculator}, ChatFormat(tokenizer))
    assert first.prompt_ids == asyncio.run(env.reset({"question": TOOL_QUESTION})).token_ids
    assert '"calculator"' in first.text and TOOL_ANSWER in second.text
    delta = ChatFormat(tokenizer).continuation(
        [{"role": "user", "content": format_tool_responses(["42"])}], after_eos=first.finish_reason == "eos"
    )
    assert second.prompt_ids == first.prompt_ids + first.response_ids + delta
    (row,) = merge_trajectory(traj)
    assert [
        t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m
    ] == first.response_ids + second.response_ids
    assert traj.outcome == 1.0 and summarize([traj])["gateway/merged_steps"] == 1.0


async def test_messages_routes_check_the_key_and_answer_in_anthropics_format(tokenizer):
    env = ProgramEnv(("true",), ChatFormat(tokenizer))
    gw = await asyncio.to_thread(gateway)
    mailbox = gw.open()
    mailbox.count_tokens = env._count_tokens
    base = gw.base_url(mailbox)
    body = {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": TOOL_QUESTION}]}
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            wrong = await http.post(f"{base}/messages", json=body, headers={"x-api-key": "nope"})
            assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
            counted = await http.post(f"{base}/messages/count_tokens", json=body, headers={"x-api-key": mailbox.token})
            expected = ChatFormat(tokenizer).initial([{"role": "user", "content": TOOL_QUESTION}])
            assert counted.json() == {"input_tokens": len(expected)}
            bad = await http.post(
                f"{base}/messages", json=body | {"max_tokens": None}, headers={"x-api-key": mailbox.token}
            )
            assert (
                bad.status_code == 400
                and bad.json()["type"] == "error"
                and "max_tokens" in bad.json()["error"]["message"]
            )
            unknown = await http.post(
                f"{base}/responses", json={"input": "hi", "previous_response_id": "resp_nope"},
                headers={"authorization": f"Bearer {mailbox.token}"},
            )  # fmt: skip
            assert unknown.status_code == 404 and "resp_nope" in unknown.json()["error"]["message"]
    finally:
        gw.close(mailbox)
