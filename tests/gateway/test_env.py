"""ProgramEnv end to end: a plain OpenAI-SDK agent program, run as a command against the gateway, rolled out
by AgentEnvLoop with a LocalEngine. Its steps are token-exact (one merged row whose sampled ids are the
engine's, log-probs the trainer recomputes), a rewritten history starts rows of its own, and a failing
program ends its episode as `error`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from openai import OpenAI
from transformers import AutoModelForCausalLM

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import format_tool_responses, tools_system_prompt
from agent_r1.env.tool_env import ToolEnv
from agent_r1.gateway import ProgramEnv, ProgramEnvFactory
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.tools import calculator
from agent_r1.trainer.rows import build_rows, recompute_old_logprobs
from agent_r1.types import Termination
from tests.conftest import TOOL_ANSWER, TOOL_QUESTION
from tests.gateway import sdk_agent

AGENT = (sys.executable, str(Path(sdk_agent.__file__)))
TASK = {"question": TOOL_QUESTION, "answer": 42}


def answer_reward(task, episode, output) -> float:
    """1 when the program printed the task's answer (its stdout) or returned it (a function)."""
    return float(str(task["answer"]) in (output.stdout or str(output.value)))


@pytest.fixture(scope="module")
def tool_model(tool_model_dir):
    return AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()


def rollout(model, tokenizer, make_env, tasks=(TASK,)):
    engine = LocalEngine(model, tokenizer, seed=0, max_context=1024)
    loop = AgentEnvLoop(engine, make_env, SamplingParams(max_new_tokens=40, temperature=1.0), seed=0)
    return loop.run_sync(list(tasks))


def test_the_sdk_agents_written_schema_is_agent_r1s_calculator():
    assert calculator.schema == sdk_agent.CALCULATOR


def test_an_sdk_tool_loop_is_one_token_exact_row(tool_model, tokenizer):
    factory = ProgramEnvFactory(tokenizer, command=AGENT, reward=answer_reward)
    (traj,) = rollout(tool_model, tokenizer, factory)
    assert traj.termination == Termination.ANSWERED, traj.error
    first, second = traj.steps  # the call, then (after the program ran the tool) the answer
    # the SDK's request renders exactly as ToolEnv renders the same question and tool: what the model learned
    env = ToolEnv({"calculator": calculator}, ChatFormat(tokenizer))
    assert first.prompt_ids == asyncio.run(env.reset({"question": TOOL_QUESTION})).token_ids
    assert '"calculator"' in first.text and TOOL_ANSWER in second.text
    # the second prompt extends the first by the sampled ids and the template's delta of the tool result alone
    tool_turn = [{"role": "user", "content": format_tool_responses(["42"])}]
    delta = ChatFormat(tokenizer).continuation(tool_turn, after_eos=first.finish_reason == "eos")
    assert second.prompt_ids == first.prompt_ids + first.response_ids + delta
    assert traj.outcome == 1.0  # the program printed 42
    (row,) = merge_trajectory(traj)
    assert row.input_ids == second.prompt_ids + second.response_ids
    sampled = [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert sampled == first.response_ids + second.response_ids
    rows, _ = build_rows([traj], [[row]])
    drift = recompute_old_logprobs(tool_model, rows, 1024, 1.0)  # the trainer's log-probs of the merged row
    assert drift["logprob_drift_max"] <= 1e-4, drift
    metrics = summarize([traj])
    assert metrics["gateway/merged_steps"] == 1.0 and metrics["gateway/fresh_steps"] == 0.0
    assert metrics["gateway/branched_steps"] == 0.0


def test_a_rewritten_history_branches_into_rows_of_its_own(tool_model, tokenizer):
    factory = ProgramEnvFactory(tokenizer, command=(*AGENT, "--rewrite"), max_turns=3)
    (traj,) = rollout(tool_model, tokenizer, factory)
    assert traj.termination in (Termination.ANSWERED, Termination.MAX_TURNS), traj.error
    assert len(traj.steps) >= 2 and '"calculator"' in traj.steps[0].text
    # the second request dropped the assistant turn: rendered afresh, nothing sampled in its prompt
    fresh = [
        {"role": "system", "content": tools_system_prompt([calculator.schema])},
        {"role": "user", "content": TOOL_QUESTION},
        {"role": "user", "content": format_tool_responses(["42"])},
    ]
    assert traj.steps[1].prompt_ids == ChatFormat(tokenizer).initial(fresh)
    rows = merge_trajectory(traj)
    assert len(rows) == len(traj.steps)  # every later request dropped the answers before it: no step extends
    for row, step in zip(rows, traj.steps, strict=True):
        assert row.input_ids == step.prompt_ids + step.response_ids
        assert row.loss_mask == [0] * len(step.prompt_ids) + [1] * len(step.response_ids)
    # each later request shares its leading messages with the first (a branch of the episode's tree): its row
    # records the longest token prefix it shares with an earlier row, computed once in the update
    shared = 0
    while traj.steps[1].prompt_ids[shared] == rows[0].input_ids[shared]:
        shared += 1
    assert (rows[1].parent, rows[1].shared) == (0, shared) and shared > len(traj.steps[0].prompt_ids) // 2
    metrics = summarize([traj])
    assert metrics["gateway/branched_steps"] == len(traj.steps) - 1
    assert metrics["gateway/merged_steps"] == metrics["gateway/fresh_steps"] == 0.0


PY = sys.executable


@pytest.mark.parametrize(
    ("command", "timeout_s", "expected"),
    [
        ((PY, "-c", "import sys; sys.stderr.write('boom: the agent broke\\n'); sys.exit(3)"), 30, "exited with code 3"),
        ((PY, "-c", "print('boom: an answer without asking anyone')"), 30, "without calling the model"),
        ((PY, "-c", "import time; print('boom', flush=True); time.sleep(60)"), 1, "within timeout_s=1s"),
        (("/nonexistent/agent", "--boom"), 30, "cannot start"),
    ],
    ids=["crash", "never-calls", "hang", "missing"],
)
def test_a_failing_program_ends_its_episode_as_error(engine, tokenizer, command, timeout_s, expected):
    envs: list[ProgramEnv] = []

    def make_env() -> ProgramEnv:
        envs.append(ProgramEnv(command, ChatFormat(tokenizer), timeout_s=timeout_s))
        return envs[-1]

    (traj,) = AgentEnvLoop(engine, make_env, SamplingParams(max_new_tokens=4)).run_sync([TASK])
    assert traj.termination == Termination.ERROR and not traj.steps
    assert expected in traj.error and "boom" in traj.error, traj.error  # what it wrote is in the error
    assert envs[0].proc is None or envs[0].proc.returncode is not None  # nothing left running
    if expected.startswith("within"):
        assert envs[0].proc.returncode == -9  # killed on close


def crash_after_one_call(task, base_url, api_key):
    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": task["question"]}]
    )
    raise ValueError("the agent's own bug")


def test_a_program_that_raises_mid_episode_is_an_error_not_a_crash(engine, tokenizer):
    factory = ProgramEnvFactory(tokenizer, function=crash_after_one_call)
    (traj,) = AgentEnvLoop(engine, factory, SamplingParams(max_new_tokens=4)).run_sync([TASK])
    assert traj.termination == Termination.ERROR
    assert "the agent program raised" in traj.error and "ValueError: the agent's own bug" in traj.error


def three_answers_go_on_from_the_last(task, base_url, api_key):
    """Asks for n=3 answers and goes on from the last one, as a best-of-n agent would from the one it picked."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "Say something."}]
    contents = [c.message.content for c in client.chat.completions.create(model="m", messages=messages, n=3).choices]
    messages += [{"role": "assistant", "content": contents[-1]}, {"role": "user", "content": "And?"}]
    client.chat.completions.create(model="m", messages=messages)
    return contents


def test_n_samples_are_the_engines_and_the_step_is_the_one_the_program_went_on_from(tool_model, tokenizer):
    seen = {}
    factory = ProgramEnvFactory(
        tokenizer, function=three_answers_go_on_from_the_last, reward=lambda task, ep, out: seen.update(vars(out)) or 1
    )
    (traj,) = rollout(tool_model, tokenizer, factory, tasks=({},))
    assert traj.termination == Termination.ANSWERED, traj.error
    first, second = traj.steps
    assert first.info["choice"] == 2 and len(set(seen["value"])) == 3  # three samples, each with its own seed
    assert seen["value"][2].strip() == first.text.removesuffix(tokenizer.eos_token).strip()
    (row,) = merge_trajectory(traj)  # the step recorded is the answer the history went on from: one row
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == first.prompt_ids + first.response_ids
    rows, _ = build_rows([traj], [[row]])
    # its log-probs are the chosen sample's (another sample's would be off by whole nats); the three were
    # decoded as one batch, whose fp32 sums run in another order than the trainer's single row: 2e-4
    drift = recompute_old_logprobs(tool_model, rows, 1024, 1.0)
    assert drift["logprob_drift_max"] <= 2e-4, drift


def report_what_it_was_given(task, base_url, api_key):
    """Asks once, then returns the task it was given and the AGENT_R1_TASK it would see as a command."""
    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": task["question"]}]
    )
    return dict(task)


@pytest.mark.parametrize(("fields", "given"), [((), None), (("question", "answer"), {"answer": 42})])
def test_the_program_gets_only_the_tasks_fields_it_is_given(engine, tokenizer, fields, given):
    """The answer stays with the reward function unless the task passes it: model-written code in a coding
    harness could otherwise read it and print it."""
    seen = {}

    def reward(task, episode, output):
        seen.update(task=task, value=output.value)
        return 0.0

    kw = {"task_fields": fields} if fields else {}
    factory = ProgramEnvFactory(tokenizer, function=report_what_it_was_given, reward=reward, **kw)
    (traj,) = AgentEnvLoop(engine, factory, SamplingParams(max_new_tokens=4)).run_sync([TASK])
    assert traj.termination != Termination.ERROR, traj.error
    assert seen["task"] == TASK  # the reward function judges against the whole task
    assert seen["value"] == {"question": TASK["question"]} | (given or {})
