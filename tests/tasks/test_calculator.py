import pytest

from agent_r1.data import split_of
from agent_r1.tasks import calculator as task_module
from agent_r1.tools.calculator import evaluate


def test_problems_are_deterministic_and_correct():
    a = task_module.make_tasks(30, seed=5, ops=(1, 2, 3))
    assert a == task_module.make_tasks(30, seed=5, ops=(1, 2, 3))
    assert a != task_module.make_tasks(30, seed=6, ops=(1, 2, 3))
    for task in a:
        assert evaluate(task["solution"]) == task["answer"] > 0  # an independent computation
    assert [t["ops"] for t in a[:3]] == [1, 2, 3]


def test_the_three_splits_are_disjoint_whatever_the_seed():
    train = {t["question"] for s in range(5) for t in task_module.make_tasks(200, seed=s)}
    val = {t["question"] for s in range(3) for t in task_module.make_tasks(100, seed=s, split="val")}
    test = {t["question"] for t in task_module.make_tasks(200, split="test")}
    assert len(val) > 250 and len(test) == 200
    assert not train & test and not train & val and not val & test


def test_reward_is_exact_numeric_match_plus_optional_format():
    task = {"answer": 1234}
    assert task_module.reward(task, "so 1,234") == (1.0, {"correct": 1.0, "format": 0.0})
    assert task_module.reward(task, "<answer>1234</answer> not 5") == (1.0, {"correct": 1.0, "format": 1.0})
    assert task_module.reward(task, "<answer>1233</answer>", format_weight=0.1) == (
        0.1,
        {"correct": 0.0, "format": 1.0},
    )
    assert task_module.reward(task, "none")[0] == 0.0


def test_split_membership_follows_the_bucket():
    for split in ("train", "val", "test"):
        assert {split_of(t["question"]) for t in task_module.make_tasks(20, ops=(1, 2, 3), split=split)} == {split}


def test_with_the_python_tool_a_demonstration_replays_exactly_in_the_sandbox(tokenizer):
    """task.tool=python: the SFT demonstration's tool response is what the real sandbox prints, so an
    episode that writes the demonstration's call gets the demonstration's observation and reward 1."""
    from agent_r1.engines.protocol import SamplingParams
    from agent_r1.env.prompt_format import ChatFormat
    from agent_r1.rollout.agent_loop import AgentEnvLoop
    from agent_r1.types import Termination
    from tests.rollout.test_agent_loop import ScriptedEngine

    options = task_module.Options(ops=(1, 2, 3), tool="python", few_shot=True)
    problems = task_module.tasks(options, "train", 3)
    demos = [task_module.demo(t, "python") for t in problems]
    script = [m["content"] for d in demos for m in d if m["role"] == "assistant"]
    env = ChatFormat(tokenizer)
    loop = AgentEnvLoop(ScriptedEngine(tokenizer, script), lambda: task_module.make_env(options, env), SamplingParams())
    trajs = [loop.run_sync([t])[0] for t in problems]  # one at a time: the script is in episode order
    for traj, d in zip(trajs, demos, strict=True):
        assert traj.termination == Termination.ANSWERED and traj.reward == 1.0
        assert traj.steps[0].info["tool_results"][0]["output"] == d[2]["content"].split("\n")[1]
    assert '"name": "python"' in task_module.make_env(options, env).system


def test_an_unknown_tool_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"task\.tool must be calculator or python, got 'abacus'"):
        task_module.Options(tool="abacus")
