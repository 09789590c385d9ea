"""task=reasoning_gym: reasoning-gym's generators (one or a weighted mix) as a task, scored by its own
score_answer, with its curriculum levels as difficulty; checked against the real package."""

from __future__ import annotations

import asyncio
import re
import sys
from collections import Counter

import pytest
import reasoning_gym

from agent_r1.config import build
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import format_tool_call
from agent_r1.task import load_task
from agent_r1.tasks import reasoning_gym as rg_task
from agent_r1.tools import calculator, execute_tool_call
from agent_r1.types import Action


def options(**kw) -> rg_task.Options:
    return build(rg_task.Options, kw, prefix="task.")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"datasets": ["chain_sum", "no_such_gym"]},
            r"unknown reasoning-gym dataset\(s\) \['no_such_gym'\]: choose from",
        ),
        ({"datasets": ["chain_sum", "products"], "weights": [1.0]}, "task.weights must be 2 positive numbers"),
        ({"datasets": ["chain_sum"], "config": {"products": {}}}, r"task.config names \['products'\]"),
        ({"tool": "abacus"}, "task.tool must be one of calculator, python, none"),
        ({"level": -1}, "task.level must be >= 0"),
    ],
)
def test_bad_options_are_one_line_errors(raw, message):
    with pytest.raises(ValueError, match=message) as err:
        options(**raw)
    assert "\n" not in str(err.value)


def test_it_is_a_built_in_task_and_a_missing_package_is_one_line_with_the_install(monkeypatch):
    assert load_task("reasoning_gym") is rg_task
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match=r"needs reasoning-gym: pip install reasoning-gym==0\.1\.25"):
        rg_task._reasoning_gym()


def test_splits_are_disjoint_deterministic_and_hold_only_the_mixs_generators():
    o = options(datasets=["chain_sum", "products"], weights=[1.0, 3.0])
    splits = {s: rg_task.tasks(o, s, 64, seed=0) for s in ("train", "val", "test")}
    questions = {s: {t["question"] for t in ts} for s, ts in splits.items()}
    assert all(len(q) == 64 for q in questions.values())
    assert not (questions["train"] & questions["val"]) and not (questions["val"] & questions["test"])
    assert not (questions["train"] & questions["test"])
    assert rg_task.tasks(o, "test", 64, seed=0) == splits["test"]
    mix = Counter(t["dataset"] for t in rg_task.tasks(o, "train", 400, seed=0))
    assert set(mix) == {"chain_sum", "products"} and 0.65 < mix["products"] / 400 < 0.85  # weights 1 : 3


def test_a_curriculum_level_and_settings_set_the_difficulty():
    def digits(o):  # the longest operand of the products questions
        return max(len(n) for t in rg_task.tasks(o, "train", 50) for n in re.findall(r"\d+", t["question"]))

    assert digits(options(datasets=["products"], level=0)) == 1  # the curriculum's easiest level: 1 digit
    assert digits(options(datasets=["products"], level=3)) == 4
    assert digits(options(datasets=["products"], level=0, config={"products": {"min_digits": 6, "max_digits": 6}})) == 6


def test_the_reward_is_reasoning_gyms_own_score():
    o = options(datasets=["chain_sum", "leg_counting"])
    for task in rg_task.tasks(o, "val", 8):
        score = reasoning_gym.get_score_answer_fn(task["dataset"])
        entry = {"question": task["question"], "answer": task["answer"], "metadata": task["metadata"]}
        assert rg_task.reward(task, f"So <answer>{task['answer']}</answer>")[0] == score(task["answer"], entry) == 1.0
        wrong = str(int(task["answer"]) + 1)
        assert rg_task.reward(task, f"<answer>{wrong}</answer>")[0] == score(wrong, entry) < 1.0
        assert rg_task.reward(task, f"<answer>{task['answer']}</answer>", format_weight=0.5)[0] == 1.5


def test_demonstrations_call_the_calculator_where_the_item_has_an_expression():
    (arith,) = rg_task.demos(options(datasets=["chain_sum"]), None, 1)
    assert [m["role"] for m in arith] == ["user", "assistant", "user", "assistant"]
    call = re.search(r'"expression": "([^"]+)"', arith[1]["content"]).group(1)
    answer = re.search(r"<answer>(.*)</answer>", arith[3]["content"]).group(1)
    result = asyncio.run(execute_tool_call({"calculator": calculator}, "calculator", {"expression": call}))
    assert result.output == answer
    (legs,) = rg_task.demos(options(datasets=["leg_counting"]), None, 1)  # no expression: answered directly
    assert [m["role"] for m in legs] == ["user", "assistant"] and legs[1]["content"].startswith("<answer>")


def test_an_episode_with_the_calculator_is_scored(tokenizer):
    o = options(datasets=["products"], level=1)
    (task,) = rg_task.tasks(o, "val", 1)
    env = rg_task.make_env(o, ChatFormat(tokenizer))
    asyncio.run(env.reset(task))
    call = format_tool_call("calculator", {"expression": task["metadata"]["expression"]})
    first = asyncio.run(env.step(Action(tokenizer.encode(call), [0.0] * len(tokenizer.encode(call)), call)))
    assert first.info["tool_calls"] == 1 and task["answer"] in tokenizer.decode(first.observation.token_ids)
    final = f"<answer>{task['answer']}</answer>"
    result = asyncio.run(env.step(Action(tokenizer.encode(final), [0.0] * len(tokenizer.encode(final)), final)))
    assert result.done and result.reward == 1.0
    bare = rg_task.make_env(options(tool="none"), ChatFormat(tokenizer))
    assert bare.system == rg_task.INSTRUCTIONS["none"] and not bare.tools
