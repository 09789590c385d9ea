"""examples/calculator_agent.py, the calculator task as an agent program of one's own: through the gateway it
prompts the policy exactly as the built-in task does (so a policy trained on one is trained for the other),
runs its own tool as the built-in calculator would answer, and is scored by the built-in reward."""

from __future__ import annotations

import asyncio

import pytest

from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.gateway import ProgramEnvFactory
from agent_r1.gateway.env import Episode, ProgramOutput
from agent_r1.tasks import calculator
from agent_r1.tools.calculator import evaluate, format_number
from examples import calculator_agent


@pytest.mark.parametrize("ops", [1, 2, 3])
def test_its_first_request_is_the_built_in_tasks_prompt_token_for_token(tokenizer, ops):
    task = calculator.make_tasks(1, seed=ops, ops=(ops,))[0]
    builtin = calculator.make_env(calculator.Options(few_shot=False), prompt_format_for(tokenizer, chat=True), 3)
    expected = asyncio.run(builtin.reset(task)).token_ids

    async def first_prompt() -> list[int]:
        env = ProgramEnvFactory(tokenizer, function="examples.calculator_agent:run", max_turns=3)()
        try:
            return (await env.reset(task)).token_ids
        finally:
            await env.close()

    assert asyncio.run(first_prompt()) == expected


@pytest.mark.parametrize("expression", ["37 * 24", "(5 - 8) * 3", "100 / 8", "10 / 3", "2 ** 10", "7 // 2", "12 % 5"])
def test_its_tool_answers_as_the_built_in_calculator(expression):
    assert calculator_agent.calculate(expression) == format_number(evaluate(expression))


def test_its_reward_is_the_built_in_tasks_on_the_printed_or_returned_answer():
    task = {"question": "?", "answer": 888}
    score = calculator_agent.reward(task, Episode([], []), ProgramOutput(0, stdout="<answer>888</answer>\n"))
    assert (
        score
        == calculator.reward(task, "<answer>888</answer>", format_weight=0.1)
        == (1.1, {"correct": 1.0, "format": 1.0})
    )
    wrong = calculator_agent.reward(task, Episode([], []), ProgramOutput(0, stdout="889\n"))
    assert wrong[0] == 0.0
    returned = calculator_agent.reward(task, Episode([], []), ProgramOutput(0, value="<answer>888</answer>"))
    assert returned == score  # run as a function: what `run` returned
