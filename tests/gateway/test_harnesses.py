"""Real agent harnesses, unchanged, trained through the gateway: Claude Code (`@anthropic-ai/claude-code` from npm,
installed by `make harnesses`), headless (`claude -p {question}`) with ANTHROPIC_BASE_URL at the episode's route.

Claude Code speaks Anthropic Messages, streams every answer, sends a system prompt, its own tools (Agent, Bash,
Edit, Read, Write, ...) and a mid-conversation system message with every request: its first prompt is some
12,000 tokens in SmolLM2's tokenizer. Each episode runs in a scratch directory of its own (its working
directory and HOME). The policy is a tiny Llama (32k positions) overfit on Claude Code's own episode, scripted
through the gateway in two scratch directories: call Bash with `echo hi > hello.txt`, then say it is done; the
reward is whether hello.txt says hi. Nothing reaches the internet: every HTTP(S) proxy is a trap (tests/gateway/
test_frameworks.py) that must count no connection.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.tool_calls import format_tool_call
from agent_r1.gateway import ProgramEnvFactory
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.trainer.rl import train
from agent_r1.types import Action, Termination
from tests.gateway.test_frameworks import internet, overfit  # noqa: F401 - the fixture
from tests.trainer.conftest import toy_config

ROOT = Path(__file__).resolve().parents[2]
CLAUDE = ROOT / "harnesses" / "node_modules" / ".bin" / "claude"
TASK = {"question": "Create a file hello.txt that says hi.", "answer": "hi"}
CALL = format_tool_call("Bash", {"command": "echo hi > hello.txt", "description": "Write hello.txt"})
DONE = "Done: hello.txt says hi."
# headless and offline: no telemetry, no update check, no error reports; IS_SANDBOX lets it skip its permission
# prompts as root (a container's user), which it otherwise refuses
CLAUDE_ENV = (
    ("IS_SANDBOX", "1"), ("DISABLE_TELEMETRY", "1"), ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
    ("DISABLE_AUTOUPDATER", "1"), ("DISABLE_ERROR_REPORTING", "1"),
)  # fmt: skip
COMMAND = (str(CLAUDE), "-p", "{question}", "--dangerously-skip-permissions")


def reward(task, episode, output) -> float:
    """1 when the episode's scratch directory holds hello.txt saying the task's answer."""
    path = Path(output.workdir) / "hello.txt"
    return float(path.is_file() and path.read_text().strip() == task["answer"])


def factory(tokenizer, proxies) -> ProgramEnvFactory:
    return ProgramEnvFactory(
        tokenizer, command=COMMAND, reward=reward, max_turns=4, timeout_s=120, env=(*CLAUDE_ENV, *proxies),
        scratch=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def claude():
    assert CLAUDE.exists(), f"Claude Code is not installed at {CLAUDE}: run `make harnesses`"
    return CLAUDE


@pytest.fixture(scope="module")
def claude_model_dir(claude, tokenizer, tmp_path_factory, internet):  # noqa: F811
    """A tiny model that does the task Claude Code's way, overfit on its real episode in two scratch directories."""

    async def episode() -> list[tuple[list[int], list[int]]]:
        env = factory(tokenizer, internet[0])()
        obs, examples = await env.reset(TASK), []
        try:
            for text, finish in ((CALL, "stop"), (DONE, "eos")):
                ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] * (finish == "eos"))
                examples.append((obs.token_ids, ids))
                result = await env.step(Action(ids, [0.0] * len(ids), text, finish))
                obs = result.observation
            assert result.done and result.reward == 1.0, result  # Claude Code ran the command and exited
        finally:
            await env.close()
        return examples

    examples = [pair for _ in range(2) for pair in asyncio.run(episode())]
    return overfit(tokenizer, examples, tmp_path_factory.mktemp("claude_model"), positions=32768)


def test_claude_code_episode_is_token_exact(claude_model_dir, tokenizer, internet):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(claude_model_dir).eval()
    engine = LocalEngine(model, tokenizer, seed=0)
    loop = AgentEnvLoop(engine, factory(tokenizer, internet[0]), SamplingParams(max_new_tokens=48), seed=0)
    (traj,) = loop.run_sync([TASK])
    assert traj.termination == Termination.ANSWERED and traj.outcome == 1.0, traj.error
    first, second = traj.steps
    assert '"Bash"' in first.text and len(first.prompt_ids) > 8000  # Claude Code's own prompt, whole
    (row,) = merge_trajectory(traj)  # Claude Code sends its history back as it got it: one row
    sampled = [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert sampled == first.response_ids + second.response_ids
    assert summarize([traj])["gateway/merged_steps"] == 1.0
    assert internet[1] == [], internet[1]


def test_two_rl_steps_with_claude_code(claude_model_dir, tokenizer, tmp_path, internet):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(claude_model_dir)
    cfg = toy_config(
        tmp_path, "steps=2", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=48",
        "rollout.max_turns=4", "optim.lr=1e-4", "algo.zero_variance_groups=keep",
    )  # fmt: skip
    hist = train(cfg, model=model, tokenizer=tokenizer, make_env=factory(tokenizer, internet[0]), tasks=[TASK] * 4)
    assert len(hist) == 2
    for h in hist:
        assert h["updates"] >= 1 and h["trained_episodes"] == 4 and h[f"termination/{Termination.ERROR}"] == 0
        assert h["reward_mean"] > 0 and h["gateway/merged_steps"] > 0
        assert h["logprob_drift_max"] < 2e-4
    assert internet[1] == [], internet[1]
