"""OpenEnvEnv against real OpenEnv servers (openenv-core's create_app, served by uvicorn on 127.0.0.1): the
example guessing game, and servers that reject, raise, stall and send malformed observations."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from agent_r1.engines.protocol import GenerateOutput, SamplingParams, no_cohort
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.merge import merge_trajectories
from agent_r1.tasks.openenv import OpenEnvEnv, local_server, stop_local_servers
from agent_r1.types import Termination
from tests.rollout.test_agent_loop import ScriptedEngine

pytest.importorskip("openenv.core", reason="the envs extra (pip install -e .[envs]) brings openenv-core")


@pytest.fixture(scope="module")
def guess_url():
    yield local_server("examples.openenv_guess:app")
    stop_local_servers()


@pytest.fixture(scope="module")
def ops_url():
    yield local_server("tests.env.openenv_apps:app")
    stop_local_servers()


class BinarySearch:
    """A policy that plays the guessing game well: it reads the game's hints back from its prompt and
    guesses the middle of what is left. `text=True` writes the bare number (text mode)."""

    max_context = 4096
    cohort = staticmethod(no_cohort)

    def __init__(self, tokenizer, text: bool = False, fixed: str | None = None):
        self.tok, self.text, self.fixed = tokenizer, text, fixed

    async def generate(self, prompts, params):
        low, high = 1, 100
        for hint, n in re.findall(r"it is (higher|lower) than (\d+)", self.tok.decode(prompts[0])):
            low, high = (max(low, int(n) + 1), high) if hint == "higher" else (low, min(high, int(n) - 1))
        guess = self.fixed or str((low + high) // 2)
        out = guess if self.text else f'<tool_call>{{"name": "act", "arguments": {{"number": {guess}}}}}</tool_call>'
        ids = self.tok.encode(out)
        return [GenerateOutput(ids, [-1.0] * len(ids), out, "stop", len(prompts[0]))]


def guesses_to_find(secret: int) -> int:
    """How many guesses the binary search takes (computed directly, without the env)."""
    low, high, n = 1, 100, 0
    while True:
        n, mid = n + 1, (low + high) // 2
        if mid == secret:
            return n
        low, high = (mid + 1, high) if mid < secret else (low, mid - 1)


def run(url, tokenizer, engine, seeds, **kw):
    fmt = ChatFormat(tokenizer)
    loop = AgentEnvLoop(engine, lambda: OpenEnvEnv(url, fmt, **kw), SamplingParams())
    return loop.run_sync([{"seed": s} for s in seeds])


def test_tool_mode_plays_the_game_with_the_servers_rewards_and_exact_tokens(guess_url, tokenizer):
    seeds = [3, 11, 42, 1234]
    trajs = run(guess_url, tokenizer, BinarySearch(tokenizer), seeds)
    for seed, t in zip(seeds, trajs, strict=True):
        secret = random.Random(seed).randint(1, 100)  # the example env's own rule
        assert t.error is None and t.termination == Termination.ANSWERED
        assert len(t.steps) == guesses_to_find(secret) and t.reward == 1.0
        assert [s.reward for s in t.steps] == [0.0] * (len(t.steps) - 1) + [1.0]  # the step that found it
        assert t.steps[-1].info["tool_results"][0]["output"] == "Correct!"
        (row,) = merge_trajectories([t])  # every step extends the last: one row, the sampled ids inside it
        text = tokenizer.decode(row.input_ids)
        assert "I am thinking of a number from 1 to 100" in text and '"name": "act"' in text
        assert "Guess the hidden number." in text  # the action's docstring is the tool's description
        if len(t.steps) > 1:
            assert f"<tool_response>\n{t.steps[0].info['tool_results'][0]['output']}\n</tool_response>" in text


def test_text_mode_sends_the_response_as_the_action_field(guess_url, tokenizer):
    (t,) = run(guess_url, tokenizer, BinarySearch(tokenizer, text=True), [7], action_field="number")
    assert t.error is None and t.reward == 1.0
    secret = random.Random(7).randint(1, 100)
    assert len(t.steps) == guesses_to_find(secret) > 1
    (row,) = merge_trajectories([t])  # the game's hint for the first guess (50) is the next user turn
    assert f"No, it is {'higher' if secret > 50 else 'lower'} than 50." in tokenizer.decode(row.input_ids)


def test_the_turn_cap_counts_actions_and_the_last_action_still_runs(guess_url, tokenizer):
    seed = next(s for s in range(100) if random.Random(s).randint(1, 100) != 1)
    (t,) = run(guess_url, tokenizer, BinarySearch(tokenizer, fixed="1"), [seed], max_turns=3)
    assert t.termination == Termination.MAX_TURNS and len(t.steps) == 3
    assert t.steps[-1].info["tool_results"][0]["output"] == "No, it is higher than 1."


def test_an_action_the_server_rejects_is_an_error_observation_and_the_episode_goes_on(guess_url, tokenizer):
    class Typo(BinarySearch):
        typed = False

        async def generate(self, prompts, params):
            if self.typed:
                return await super().generate(prompts, params)
            self.typed, out = True, "fifty"  # not an int: the server's validation refuses it
            ids = self.tok.encode(out)
            return [GenerateOutput(ids, [-1.0] * len(ids), out, "stop", len(prompts[0]))]

    (t,) = run(guess_url, tokenizer, Typo(tokenizer, text=True), [5], action_field="number")
    assert t.steps[0].info["tool_errors"] == {"invalid_action": 1} and t.steps[0].reward is None
    assert t.error is None and t.reward == 1.0  # it went on and found the number


def test_an_env_that_raises_is_an_error_observation(ops_url, tokenizer):
    (t,) = run(ops_url, tokenizer, Script(tokenizer, ["raise", "end"]), [0])
    assert t.steps[0].info["tool_errors"] == {"env_error": 1}
    assert "the env broke on this action" in t.steps[0].info["tool_results"][0]["output"]
    assert t.termination == Termination.ANSWERED and t.steps[1].reward == 0.25


def test_a_server_slower_than_the_timeout_ends_the_episode_as_an_error(ops_url, tokenizer):
    (t,) = run(ops_url, tokenizer, Script(tokenizer, ["sleep"]), [0], timeout_s=0.5)
    assert t.termination == Termination.ERROR and "failed a step" in t.error


def test_a_server_that_is_down_is_an_errored_episode_not_a_crash(tokenizer):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (t,) = run(f"http://127.0.0.1:{port}", tokenizer, Script(tokenizer, ["ok"]), [0], timeout_s=2)
    assert t.termination == Termination.ERROR and "did not answer reset" in t.error and not t.steps


def test_malformed_observations_are_error_observations(ops_url, tokenizer):
    (t,) = run(f"{ops_url}/raw", tokenizer, Script(tokenizer, ["text", "reward", "end"]), [0])
    assert [s.info["tool_errors"] for s in t.steps[:2]] == [{"malformed_observation": 1}] * 2
    assert "not an object" in t.steps[0].info["tool_results"][0]["output"]
    assert "reward is not a number" in t.steps[1].info["tool_results"][0]["output"]
    assert t.termination == Termination.ANSWERED and t.reward == 1.0


def test_episodes_beyond_the_servers_capacity_wait_for_a_session(ops_url, tokenizer):
    """The server takes 2 sessions; 5 episodes at once all finish (no CAPACITY_REACHED errors)."""
    trajs = run(ops_url, tokenizer, Script(tokenizer, ["ok", "end"] * 5, shared=False), range(5))
    assert all(t.error is None and t.termination == Termination.ANSWERED for t in trajs)
    assert [t.reward for t in trajs] == [0.5] * 5


def test_two_calls_in_one_turn_are_two_steps_in_order(ops_url, tokenizer):
    call = '<tool_call>{{"name": "act", "arguments": {{"op": "{}"}}}}</tool_call>'
    both = call.format("ok") + call.format("ok")
    (t,) = run(ops_url, tokenizer, Script(tokenizer, [both, "end"], raw=True), [0])
    outputs = [r["output"] for r in t.steps[0].info["tool_results"]]
    assert outputs == ["did ok #1", "did ok #2"] and t.steps[0].reward == 0.5


class Script:
    """Writes `op` calls in order (one list per episode when `shared=False`: each prompt's own count)."""

    max_context = 4096
    cohort = staticmethod(no_cohort)

    def __init__(self, tokenizer, ops, shared=True, raw=False):
        self.tok, self.ops, self.shared, self.raw = tokenizer, list(ops), shared or raw, raw

    async def generate(self, prompts, params):
        await asyncio.sleep(0.01)  # let other episodes run, as a real engine does
        # shared: the next op of the list; else "ok" on an episode's first turn, then "end"
        op = self.ops.pop(0) if self.shared else "end" if "did ok" in self.tok.decode(prompts[0]) else "ok"
        if self.raw and op.startswith("<tool_call>"):
            out = op
        else:
            out = f'<tool_call>{{"name": "act", "arguments": {{"op": "{op}", "seconds": 3}}}}</tool_call>'
        ids = self.tok.encode(out)
        return [GenerateOutput(ids, [-1.0] * len(ids), out, "stop", len(prompts[0]))]


def test_an_mcp_environments_tools_are_offered_as_themselves(ops_url, tokenizer):
    """OpenEnv's MCP environments (RFC 003): the listed tools are the model's, each call one step; the
    question comes from the task (the reset shows nothing); a tool's own error is an error observation."""
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
    script = [
        call.format("add", '{"a": 3, "b": 4}'),
        call.format("add", '{"a": 1}'),
        call.format("hint", "{}"),
        call.format("submit", '{"answer": 7}'),
    ]
    fmt = ChatFormat(tokenizer)
    loop = AgentEnvLoop(ScriptedEngine(tokenizer, script), lambda: OpenEnvEnv(f"{ops_url}/quiz", fmt), SamplingParams())
    (t,) = loop.run_sync([{"seed": 3, "question": "What is 3 + 4?"}])  # the quiz's answer is 2 * seed + 1 = 7
    assert t.error is None and t.termination == Termination.ANSWERED and t.reward == 1.0
    assert t.steps[0].info["tool_results"][0]["output"] == "7"
    assert t.steps[1].info["tool_errors"] == {"invalid_arguments": 1}  # caught by the listed schema, never sent
    assert t.steps[2].info["tool_errors"] == {"tool_error": 1}  # the tool raised on the server
    assert "no hints today" in t.steps[2].info["tool_results"][0]["output"]
    prompt = tokenizer.decode(t.steps[0].prompt_ids)
    assert "What is 3 + 4?" in prompt and "Add two whole numbers." in prompt and "Submit the final answer." in prompt
