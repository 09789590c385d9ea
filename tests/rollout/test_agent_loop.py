"""The agent loop end to end with the tiny model, and the log-prob consistency guard rail."""

import pytest
import torch

from agent_r1.engines.protocol import GenerateOutput, SamplingParams, no_cohort
from agent_r1.env.base import Env, StepResult
from agent_r1.rollout.agent_loop import AgentEnvLoop, obs_state, summarize
from agent_r1.rollout.merge import merge_trajectories
from agent_r1.types import Observation, Termination
from tests.conftest import recompute_logprobs


class ChattyEnv(Env):
    """Always answers with a fixed observation for `turns` turns; optionally rewrites the context."""

    def __init__(self, tokenizer, turns=3, rewrite=False):
        self.tok, self.turns, self.rewrite = tokenizer, turns, rewrite

    async def reset(self, task):
        self.n = 0
        self.context = self.tok.encode(task["question"])
        return Observation(token_ids=list(self.context))

    async def step(self, action):
        self.n += 1
        if self.n >= self.turns:
            return StepResult(None, 1.0, True, {"termination": Termination.ANSWERED})
        obs = self.tok.encode(f"\nobservation {self.n}:")
        if self.rewrite:  # keep the question, drop the history
            self.context = self.context[:3] + obs
        else:
            self.context = self.context + action.token_ids + obs
        return StepResult(Observation(token_ids=list(self.context)), 0.5, False, {})


TASKS = [
    {"question": "What is 17 times 23?"},
    {"question": "Hi"},
    {"question": "A much longer question about apples."},
]


def run(engine, tokenizer, rewrite=False, group=2, turns=3, temperature=1.0):
    loop = AgentEnvLoop(
        engine,
        lambda: ChattyEnv(tokenizer, turns, rewrite),
        SamplingParams(max_new_tokens=12, temperature=temperature),
        seed=1,
    )
    return loop.run_sync(TASKS, group_size=group)


def max_logprob_gap(model, rows) -> float:
    gap = 0.0
    for row in rows:
        ref = recompute_logprobs(model, row.input_ids)  # [T-1] predicts tokens 1..T-1
        mask = torch.tensor(row.loss_mask[1:], dtype=torch.bool)
        got = torch.tensor(row.logprobs[1:])
        gap = max(gap, (ref[mask] - got[mask]).abs().max().item())
    return gap


def test_multi_turn_rollout_is_token_exact(engine, tiny_model, tokenizer):
    trajs = run(engine, tokenizer)
    assert len(trajs) == 6 and len({t.group_id for t in trajs}) == 3
    assert all(t.termination == Termination.ANSWERED and len(t.steps) == 3 for t in trajs)
    rows = merge_trajectories(trajs)
    assert len(rows) == 6  # every trajectory merged into one row
    assert all(sum(r.loss_mask) == sum(len(s.response_ids) for s in t.steps) for r, t in zip(rows, trajs, strict=True))
    assert max_logprob_gap(tiny_model, rows) <= 1e-4


def test_rewritten_contexts_stay_separate_and_exact(engine, tiny_model, tokenizer):
    trajs = run(engine, tokenizer, rewrite=True, group=1)
    rows = merge_trajectories(trajs)
    assert len(rows) == 3 * 3  # the prefix breaks every step
    assert max_logprob_gap(tiny_model, rows) <= 1e-4


def test_same_seed_same_rollout(engine, tokenizer):
    a = run(engine, tokenizer, group=1)
    b = run(engine, tokenizer, group=1)
    assert [s.response_ids for t in a for s in t.steps] == [s.response_ids for t in b for s in t.steps]


def test_positions_sample_a_share_of_the_tasks_as_the_whole_run_does(engine, tokenizer):
    """A resumed eval runs only the tasks a killed one left (`positions`): their samples must be seeded as in
    the uninterrupted run, or a resumed eval at temperature > 0 would measure other samples."""
    whole = run(engine, tokenizer)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    loop = AgentEnvLoop(engine, lambda: ChattyEnv(tokenizer), sampling, seed=1)
    share, other = loop.run_sync([TASKS[2], TASKS[0]], group_size=2, positions=[2, 0]), loop.run_sync(TASKS[2:], 2)
    responses = lambda trajs: [[s.response_ids for s in t.steps] for t in trajs]  # noqa: E731
    assert responses(share) == responses(whole[4:] + whole[:2])
    assert responses(other) != responses(whole[4:])  # without positions it is sampled as task 0
    with pytest.raises(ValueError, match="positions: 1 for 2 tasks"):
        loop.run_sync(TASKS[:2], positions=[0])


def test_slow_steps_roll_out_without_a_lockstep_cohort(engine, tokenizer, monkeypatch):
    """A lockstep cohort waits for every episode's env step before decoding on: with τ²'s customer (a model
    call of seconds) the customers answered one at a time and a 20-conversation eval took hours. A task
    that declares SLOW_STEPS rolls out without one; every other task keeps its timing-free batches."""
    from agent_r1.task import TaskSpec

    opened, real = [], engine.cohort
    monkeypatch.setattr(engine, "cohort", lambda size: (opened.append(size), real(size))[1])

    class Factory:  # what the loop reads of an EnvFactory: a callable with the task's slow_steps
        def __init__(self, slow):
            self.slow_steps = slow

        def __call__(self):
            return ChattyEnv(tokenizer)

    for slow in (False, True):
        trajs = AgentEnvLoop(engine, Factory(slow), SamplingParams(max_new_tokens=4)).run_sync(TASKS[:2], 2)
        assert len(trajs) == 4 and all(t.steps for t in trajs)
    assert opened == [4]  # the fast task's 4 episodes in one cohort, the slow task's in none
    assert TaskSpec("tau2").env_factory(tokenizer, True, 4).slow_steps
    assert not TaskSpec("calculator").env_factory(tokenizer, True, 4).slow_steps


def test_rewards_and_metrics(engine, tokenizer):
    trajs = run(engine, tokenizer, group=1, turns=2)
    assert all(t.rewards == [0.5, 1.0] and t.reward == 1.5 for t in trajs)
    m = summarize(trajs)
    assert m["turns"] == 2 and m["reward"] == 1.5 and m["termination/answered"] == 1.0


class BrokenEnv(ChattyEnv):
    async def step(self, action):
        raise RuntimeError("env exploded")


def test_env_exception_ends_the_trajectory_not_the_run(engine, tokenizer):
    loop = AgentEnvLoop(engine, lambda: BrokenEnv(tokenizer), SamplingParams(max_new_tokens=4))
    (t,) = loop.run_sync(TASKS[:1])
    assert t.termination == Termination.ERROR and "env exploded" in t.error


def test_an_env_that_cannot_be_made_ends_its_trajectory_not_the_run(engine, tokenizer):
    """A local server that cannot restart raises in `make_env`: that episode errors, the others run."""
    made = []

    def make_env():
        made.append(1)
        if len(made) == 1:
            raise ConnectionError("the env server did not come back")
        return ChattyEnv(tokenizer, turns=2)

    trajs = AgentEnvLoop(engine, make_env, SamplingParams(max_new_tokens=4), seed=0).run_sync(TASKS[:1], group_size=3)
    assert [t.termination for t in trajs].count(Termination.ERROR) == 1
    assert "did not come back" in next(t.error for t in trajs if t.error)
    assert [t.termination for t in trajs].count(Termination.ANSWERED) == 2


class DuckEnv:
    """An env written against the old protocol: reset and step, no base class."""

    async def reset(self, task):
        return Observation(token_ids=[1, 2])

    async def step(self, action):
        return StepResult(None, 1.0, True, {})


def test_an_env_that_is_not_an_env_errors_its_episode_naming_the_base_class(engine, tokenizer):
    """The loop calls `stop`, `samples` and `close` without probing: an env must subclass Env, which gives
    them their defaults, and one that does not is told so in its episodes' error."""
    (t,) = AgentEnvLoop(engine, DuckEnv, SamplingParams(max_new_tokens=4)).run_sync(TASKS[:1])
    assert t.termination == Termination.ERROR and not t.steps
    assert t.error == "TypeError: DuckEnv is not an agent_r1.env.base.Env: subclass it"
    env = ChattyEnv(tokenizer)  # the defaults a subclass gets
    assert (env.stop, env.samples) == ((), 1)


class OddPartsEnv(ChattyEnv):
    async def step(self, action):
        return StepResult(None, 1.0, True, {"reward_parts": {"judge": "n/a"}})


def test_an_info_that_is_not_a_number_ends_the_trajectory_as_errored(engine, tokenizer):
    (t,) = AgentEnvLoop(engine, lambda: OddPartsEnv(tokenizer), SamplingParams(max_new_tokens=4)).run_sync(TASKS[:1])
    assert t.termination == Termination.ERROR and "n/a" in t.error and t.metrics["turns"] == 1.0


def test_the_env_ends_a_long_episode_not_a_cap_in_the_loop(engine, tokenizer):
    """τ², BFCL's multi-turn and the gateway take more than 32 model calls: the loop must not cut them."""
    loop = AgentEnvLoop(engine, lambda: ChattyEnv(tokenizer, turns=40), SamplingParams(max_new_tokens=1), seed=0)
    (t,) = loop.run_sync(TASKS[1:2])
    assert len(t.steps) == 40 and t.termination == Termination.ANSWERED and t.reward == 0.5 * 39 + 1.0


def test_context_overflow_ends_the_trajectory(engine, tokenizer):
    engine.max_context = 30
    trajs = run(engine, tokenizer, group=1, turns=10)
    long = trajs[2]
    assert long.termination == Termination.CONTEXT_OVERFLOW
    assert all(len(s.prompt_ids) + len(s.response_ids) <= 30 for t in trajs for s in t.steps)


class ScriptedEngine:
    """Returns fixed responses in order: lets ToolEnv tests drive exact model outputs."""

    max_context = 4096
    cohort = staticmethod(no_cohort)

    def __init__(self, tokenizer, responses):
        self.tok, self.responses = tokenizer, list(responses)

    async def generate(self, prompts, params):
        text = self.responses.pop(0)
        ids = self.tok.encode(text)
        return [GenerateOutput(ids, [-1.0] * len(ids), text, "stop", len(prompts[0]))]


def test_loop_with_tool_env_and_echo_tool(tokenizer):
    from agent_r1.env.prompt_format import ChatFormat
    from agent_r1.env.tool_env import ToolEnv
    from agent_r1.tools import echo

    def reward(task, text):  # 1 only if the echo tool really ran and its output was used
        return float(text == "<answer>ping-42</answer>")

    engine = ScriptedEngine(
        tokenizer,
        [
            '<tool_call>{"name": "echo", "arguments": {"text": "ping-42"}}</tool_call>',
            "<answer>ping-42</answer>",
        ],
    )
    loop = AgentEnvLoop(engine, lambda: ToolEnv({"echo": echo}, ChatFormat(tokenizer), reward), SamplingParams())
    (t,) = loop.run_sync([{"question": "echo ping-42"}])
    assert t.termination == Termination.ANSWERED and t.reward == 1.0
    assert t.metrics["tool_calls"] == 1 and t.metrics["turns"] == 2
    assert t.steps[0].info["tool_results"][0]["output"] == "ping-42"
    (row,) = merge_trajectories([t])
    assert "<tool_response>\nping-42\n</tool_response>" in tokenizer.decode(row.input_ids)
    assert t.metrics["tool_calls/echo"] == 1  # each tool's calls are counted apart


def test_steps_record_the_state_they_acted_from(tokenizer):
    """GiGPO groups steps by state: ToolEnv's is what the tools showed (the same first state for every
    sample of a task); an env without one falls back to a digest of the prompt."""
    from agent_r1.env.prompt_format import ChatFormat
    from agent_r1.env.tool_env import ToolEnv
    from agent_r1.tools import echo

    call = '<think>{}</think><tool_call>{{"name": "echo", "arguments": {{"text": "x"}}}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call.format("a"), call.format("b"), "<answer>1</answer>", "<answer>2</answer>"])
    loop = AgentEnvLoop(engine, lambda: ToolEnv({"echo": echo}, ChatFormat(tokenizer)), SamplingParams())
    first, second = loop.run_sync([{"question": "q"}, {"question": "q"}])
    assert [s.state for s in first.steps] == [s.state for s in second.steps]  # different thoughts, same results
    assert first.steps[0].state != first.steps[1].state
    chatty = AgentEnvLoop(ScriptedEngine(tokenizer, ["a", "b"]), lambda: ChattyEnv(tokenizer, 2), SamplingParams())
    (t,) = chatty.run_sync([{"question": "q"}])
    assert t.steps[0].state == obs_state(None, t.steps[0].prompt_ids) and t.steps[0].state != t.steps[1].state


class SlowToolEnv(ChattyEnv):
    """ChattyEnv whose every step takes a random 0-30 ms (drawn from an unseeded generator), like a
    real tool: which trajectories are back first differs from run to run."""

    async def step(self, action):
        import asyncio
        import random

        await asyncio.sleep(random.random() * 0.03)
        return await super().step(action)


def test_rollouts_do_not_depend_on_when_tools_return(tiny_model, tokenizer):
    """Rows' logits differ in their last bits with the batch they share, so a resumed run equals an
    uninterrupted one only if batches do not depend on timing: the loop's trajectories are a cohort."""
    from agent_r1.engines.cpu.local_engine import LocalEngine

    def rollout():
        engine = LocalEngine(tiny_model, tokenizer, seed=0, max_context=1024)
        loop = AgentEnvLoop(
            engine, lambda: SlowToolEnv(tokenizer, turns=4), SamplingParams(max_new_tokens=10, temperature=1.0), seed=3
        )
        trajs = loop.run_sync(TASKS * 3, group_size=2)
        return [(s.prompt_ids, s.response_ids, s.response_logprobs) for t in trajs for s in t.steps]

    first, second = rollout(), rollout()
    assert len(first) == 3 * 3 * 2 * 4
    assert first == second  # token ids and log-probs, bit for bit
