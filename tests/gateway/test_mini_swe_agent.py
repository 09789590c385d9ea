"""mini-swe-agent (`mini`, from PyPI), unchanged, trained through the gateway with OPENAI_BASE_URL at it. Its first
prompt is 1,050 tokens and the same in every episode (no path in it): a tiny Llama overfit on its real episode
solves the task, and a group's rows share the whole prompt. Nothing reaches the internet: every HTTP(S) proxy is a
trap (tests/gateway/test_frameworks.py) that must count no connection."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoModelForCausalLM

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.tool_calls import format_tool_call
from agent_r1.gateway import ProgramEnvFactory
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.tasks.coding import MINI, MINI_ENV, SUBMIT
from agent_r1.trainer.rl import train
from agent_r1.types import Action, Termination
from tests.gateway.test_frameworks import internet, overfit  # noqa: F401 - the fixture
from tests.gateway.test_harnesses import TASK, reward
from tests.trainer.conftest import toy_config

BASH = [format_tool_call("bash", {"command": c}) for c in ("echo hi > hello.txt", SUBMIT)]


def mini_factory(tokenizer, proxies) -> ProgramEnvFactory:
    return ProgramEnvFactory(
        tokenizer, command=MINI, reward=reward, max_turns=4, timeout_s=120, env=(*MINI_ENV, *proxies), scratch=True
    )


@pytest.fixture(scope="module")
def mini_model_dir(tokenizer, tmp_path_factory, internet):  # noqa: F811
    """A tiny model overfit on mini-swe-agent's real episode through the gateway: the bash call, then the submit."""

    async def episode() -> list[tuple[list[int], list[int]]]:
        env = mini_factory(tokenizer, internet[0])()
        obs, examples = await env.reset(TASK), []
        try:
            for text in BASH:
                ids = tokenizer.encode(text, add_special_tokens=False)
                examples.append((obs.token_ids, ids))
                result = await env.step(Action(ids, [0.0] * len(ids), text, "stop"))
                obs = result.observation
            assert result.done and result.reward == 1.0, result  # mini ran the command, submitted and exited
        finally:
            await env.close()
        return examples

    return overfit(tokenizer, asyncio.run(episode()), tmp_path_factory.mktemp("mini_model"))


def test_mini_swe_agent_episode_is_token_exact(mini_model_dir, tokenizer, internet):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(mini_model_dir).eval()
    engine = LocalEngine(model, tokenizer, seed=0)
    loop = AgentEnvLoop(engine, mini_factory(tokenizer, internet[0]), SamplingParams(max_new_tokens=40), seed=0)
    (traj,) = loop.run_sync([TASK])
    assert traj.termination == Termination.ANSWERED and traj.outcome == 1.0, traj.error
    steps = traj.steps  # the call, then the submit (an answer it cannot parse is asked again first)
    assert "hello.txt" in steps[0].text and len(steps) >= 2
    # every sampled id trained once, as sampled: one row while mini-swe-agent sends its history back as it got
    # it; an answer it could not parse goes back as its own message, and the step after it branches
    rows = merge_trajectory(traj)
    trained = sorted(
        ((k, t) for r in rows for t, m, k in zip(r.input_ids, r.loss_mask, r.step_index, strict=True) if m),
        key=lambda kt: kt[0],
    )
    assert [t for _, t in trained] == [t for step in steps for t in step.response_ids]
    metrics = summarize([traj])
    assert metrics["gateway/merged_steps"] >= 1  # the well-formed call's result came back as it was
    assert metrics["gateway/merged_steps"] + metrics["gateway/branched_steps"] == len(steps) - 1
    assert internet[1] == [], internet[1]


def test_two_rl_steps_with_mini_swe_agent(mini_model_dir, tokenizer, tmp_path, internet):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(mini_model_dir)
    cfg = toy_config(
        tmp_path, "steps=2", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=40",
        "rollout.max_turns=4", "optim.lr=1e-4", "algo.zero_variance_groups=keep", "optim.micro_batch_tokens=4096",
    )  # fmt: skip
    make_env = mini_factory(tokenizer, internet[0])
    hist = train(cfg, model=model, tokenizer=tokenizer, make_env=make_env, tasks=[TASK] * 4)
    assert len(hist) == 2
    for h in hist:
        assert h["updates"] >= 1 and h["trained_episodes"] == 4 and h[f"termination/{Termination.ERROR}"] == 0
        assert h["reward_mean"] > 0 and h["gateway/merged_steps"] > 0
        assert h["logprob_drift_max"] < 2e-4
        assert h["computed_share"] < 0.5  # the episodes' rows share mini-swe-agent's whole prompt: computed once
    assert internet[1] == [], internet[1]
