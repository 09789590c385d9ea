"""Real agent frameworks through the gateway, each as its users write it (the agents are tests/gateway/*_agent.py):
the OpenAI Agents SDK (`openai-agents`), LangGraph over LangChain's `ChatOpenAI`, and smolagents' `ToolCallingAgent`.
Each solves sdk_agent.py's calculator task as a command, with OPENAI_BASE_URL and OPENAI_API_KEY from the
gateway, and trains two RL steps with `train()` as test_train.py does.

What merges, measured here and explained in docs/agents.md ("Frameworks"):

* the Agents SDK (with its Chat Completions model, and for one episode with its default, Responses model) and
  LangGraph send the history back as they got it: every later step merges (share 1.0), and
  their requests render exactly as ToolEnv's, so the tiny tool model (overfit on ToolEnv's episode) calls the tool;
* smolagents re-renders its memory as its own messages (a call becomes the assistant text "Calling tools:\\n[...]",
  its result the user text "Observation:\\n..."), so a step after a call is rendered afresh and starts a row of its
  own whose prompt is never trained (share 0.0 when the model calls well; an answer smolagents cannot parse is
  re-sent verbatim and does merge). Its first prompt (its system prompt, a `final_answer` tool: 1,300 tokens) is
  not the ToolEnv prompt the tool model learned, so the smolagents runs use a tiny model overfit on smolagents'
  own episode, with the gateway's call ids fixed (`fixed_call_ids`): smolagents writes them into the history it
  re-sends, and a two-layer model that memorised one episode cannot read past a random id (a real policy can).

Nothing reaches the internet: every program's HTTP(S) proxy is a trap that counts connections (the gateway,
on 127.0.0.1, is in NO_PROXY), and it must count none.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import format_tool_call
from agent_r1.env.tool_env import ToolEnv
from agent_r1.gateway import ProgramEnv, ProgramEnvFactory
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.tools import calculator
from agent_r1.trainer.rl import train
from agent_r1.types import Action, Termination
from tests.conftest import make_tiny_llama
from tests.gateway.test_env import TASK
from tests.trainer.conftest import toy_config

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = {"openai-agents": "agents_sdk_agent", "langgraph": "langgraph_agent", "smolagents": "smolagents_agent"}
# whether the framework sends the history back as it got it (every later step merges) or re-renders it
RESENDS_HISTORY = {"openai-agents": True, "openai-agents-responses": True, "langgraph": True, "smolagents": False}


def command(framework: str) -> tuple[str, ...]:
    if framework == "openai-agents-responses":  # the Agents SDK's default model: the Responses API
        return (sys.executable, "-m", "tests.gateway.agents_sdk_agent", "--responses")
    return (sys.executable, "-m", f"tests.gateway.{FRAMEWORKS[framework]}")


@pytest.fixture(scope="module")
def internet():
    """(the environment that routes a program's HTTP(S) through a trap, the requests the trap saw)."""
    seen: list[str] = []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def trap() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):
                conn.settimeout(1)
                seen.append(conn.recv(256).decode(errors="replace").split("\r\n")[0] or "(a connection)")

    thread = threading.Thread(target=trap, daemon=True)
    thread.start()
    proxy = f"http://127.0.0.1:{server.getsockname()[1]}"
    names = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
    # LangSmith uploads only when LANGSMITH_TRACING is on: off here whatever the developer's shell says
    env = (*((name, proxy) for name in names), ("LANGSMITH_TRACING", "false"))
    yield env, seen
    stop.set()
    thread.join()
    server.close()


def factory(tokenizer, framework: str, env, **kwargs) -> ProgramEnvFactory:
    return ProgramEnvFactory(
        tokenizer, command=command(framework), reward="tests.gateway.test_train:reward", max_turns=3,
        env=env, cwd=str(ROOT), **kwargs,
    )  # fmt: skip


def overfit(tokenizer, examples: list[tuple[list[int], list[int]]], out: Path, positions: int = 4096) -> Path:
    """A tiny Llama (`positions` positions) overfit on (prompt, response) pairs as tests/conftest.py's tool model is,
    then its logits sharpened fourfold (its final norm's weight): at temperature 1 it then writes what it learned
    all but always, as a policy that has learned the format does (per-token misses of 1% would fail an episode in
    two: the smolagents episode is two 30-token calls)."""
    model = make_tiny_llama(len(tokenizer), hidden=32, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=1)
    model.config.max_position_embeddings = positions
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        losses = []
        for prompt, response in examples:
            ids = torch.tensor([prompt + response])
            hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]  # the rows predicting the response
            losses.append(torch.nn.functional.cross_entropy(model.lm_head(hidden), ids[0, len(prompt) :]))
        loss = torch.stack(losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    with torch.no_grad():
        model.model.norm.weight.mul_(4)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def smolagents_model_dir(tokenizer, tmp_path_factory, internet):
    """A tiny model that solves the task smolagents' way: its episode, scripted through the gateway (the prompts
    are the gateway's renderings of smolagents' real requests), then overfit on: call the calculator, then
    `final_answer` with its result."""
    calls = [
        format_tool_call("calculator", {"expression": "6 * 7"}),
        format_tool_call("final_answer", {"answer": "42"}),
    ]

    async def episode() -> list[tuple[list[int], list[int]]]:
        env = ProgramEnv(command("smolagents"), ChatFormat(tokenizer), env=dict(internet[0]), cwd=str(ROOT))
        obs, examples = await env.reset(TASK), []
        try:
            for call in calls:
                text = call.removeprefix(env.forced)  # smolagents asks with tool_choice="required": the call is open
                ids = tokenizer.encode(text, add_special_tokens=False)
                examples.append((obs.token_ids, ids))
                result = await env.step(Action(ids, [0.0] * len(ids), text, "stop"))
                obs = result.observation
            assert result.done and result.reward is None, result  # smolagents printed 42 and exited
        finally:
            await env.close()
        return examples

    with fixed_call_ids("smolagents"):
        examples = asyncio.run(episode())
    return overfit(tokenizer, examples, tmp_path_factory.mktemp("smolagents_model"))


@contextlib.contextmanager
def fixed_call_ids(framework: str):
    """Every tool call id the gateway gives is call_000...: smolagents' re-rendered history is the same in every
    episode (see the module's docstring); for the other frameworks, nothing changes."""
    with pytest.MonkeyPatch.context() as patch:
        if framework == "smolagents":
            patch.setattr("agent_r1.api.messages.uuid", SimpleNamespace(uuid4=lambda: SimpleNamespace(hex="0" * 32)))
        yield


def model_dir(request, framework: str) -> Path:
    return request.getfixturevalue("smolagents_model_dir" if framework == "smolagents" else "tool_model_dir")


@pytest.mark.parametrize("framework", [*FRAMEWORKS, "openai-agents-responses"])
def test_a_framework_episode_is_token_exact(request, tokenizer, internet, framework):
    """One episode: the model's calls reach the framework's tools and its answer the reward; the rows train the
    sampled ids only, one row when the framework re-sends its history, a row per step when it re-renders it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir(request, framework)).eval()
    engine = LocalEngine(model, tokenizer, seed=0)
    loop = AgentEnvLoop(engine, factory(tokenizer, framework, internet[0]), SamplingParams(max_new_tokens=40), seed=0)
    with fixed_call_ids(framework):
        (traj,) = loop.run_sync([TASK])
    assert traj.termination == Termination.ANSWERED and traj.outcome == 1.0, traj.error
    assert len(traj.steps) == 2 and '"calculator"' in traj.steps[0].text
    metrics = summarize([traj])
    assert metrics["tool_calls"] >= 1 and metrics["format_errors"] == 0
    rows = merge_trajectory(traj)
    if RESENDS_HISTORY[framework]:
        # its request renders exactly as ToolEnv's for the same question and tool, and the episode is one row
        env = ToolEnv({"calculator": calculator}, ChatFormat(tokenizer))
        assert traj.steps[0].prompt_ids == asyncio.run(env.reset({"question": TASK["question"]})).token_ids
        assert len(rows) == 1 and metrics["gateway/merged_steps"] == 1.0 and metrics["gateway/fresh_steps"] == 0.0
        first, second = traj.steps
        assert rows[0].input_ids == second.prompt_ids + second.response_ids
        sampled = [t for t, m in zip(rows[0].input_ids, rows[0].loss_mask, strict=True) if m]
        assert sampled == first.response_ids + second.response_ids  # the sampled ids, in place, and only those
    else:
        # the call came back as smolagents' own text: rendered afresh, a row of its own, its prompt untrained
        assert "Calling tools:" in tokenizer.decode(traj.steps[1].prompt_ids)
        assert len(rows) == 2 and metrics["gateway/merged_steps"] == 0.0 and metrics["gateway/branched_steps"] == 1.0
        assert rows[1].parent == 0 and rows[1].shared > 0  # its system prompt and question, computed once
        for row, step in zip(rows, traj.steps, strict=True):
            assert row.input_ids == step.prompt_ids + step.response_ids
            assert row.loss_mask == [0] * len(step.prompt_ids) + [1] * len(step.response_ids)
    assert internet[1] == [], internet[1]


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_two_rl_steps_with_a_framework_agent(request, tmp_path, tokenizer, internet, record_property, framework):
    model = AutoModelForCausalLM.from_pretrained(model_dir(request, framework))
    cfg = toy_config(
        tmp_path, "steps=2", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=40",
        "optim.lr=1e-4", "algo.zero_variance_groups=keep",
    )  # fmt: skip
    with fixed_call_ids(framework):
        hist = train(
            cfg, model=model, tokenizer=tokenizer, make_env=factory(tokenizer, framework, internet[0]), tasks=[TASK] * 4
        )
    assert len(hist) == 2
    for h in hist:
        assert h["updates"] >= 1 and h["trained_episodes"] == 4 and h[f"termination/{Termination.ERROR}"] == 0
        assert h["reward_mean"] > 0 and h["tool_calls"] > 0  # the model's calls, which the framework ran
        # fp32 noise of the overfit tiny model's peaked logits, as in test_train.py; a misplaced token is whole nats
        assert h["logprob_drift_max"] < 2e-4
    merged = sum(h["gateway/merged_steps"] for h in hist)
    other = sum(h["gateway/branched_steps"] + h["gateway/fresh_steps"] for h in hist)
    share = merged / (merged + other)
    record_property("merge_share", share)  # the share of later steps that extended the previous prompt
    print(f"{framework}: {share:.0%} of later steps merged")
    if RESENDS_HISTORY[framework]:
        assert share == 1.0
    else:
        assert other > 0 and share < 1.0  # rendered afresh after a call; never trained as if sampled
    assert internet[1] == [], internet[1]
