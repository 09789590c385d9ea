"""Real agent harnesses, unchanged, trained through the gateway: here Claude Code (`@anthropic-ai/claude-code` from
npm, installed by `make harnesses`), headless (`claude -p {question}`) with ANTHROPIC_BASE_URL at the episode's
route, and what the harness tests share; OpenClaw and mini-swe-agent in test_openclaw.py and
test_mini_swe_agent.py.

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
Nothing reaches the internet: every HTTP(S) proxy is a trap (tests/gateway/test_frameworks.py) that must count
no connection.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from agent_r1.env.tool_calls import format_tool_call
from agent_r1.gateway import ProgramEnvFactory
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


def two_rl_steps_of_a_done_sayer(make_env, tokenizer, tmp_path, episodes: int, prompt=None) -> list[dict]:
    """Two RL steps with `train()` on `episodes` episodes a step of the harness `make_env` runs, the policy a
    tiny model taught to answer the harness's first prompt (`prompt`, else one episode's) with DONE."""

    async def first_prompt() -> list[int]:
        env = make_env()
        try:
            return (await env.reset(TASK)).token_ids
        finally:
            await env.close()

    model = says_done(tokenizer, prompt if prompt is not None else asyncio.run(first_prompt()))
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
