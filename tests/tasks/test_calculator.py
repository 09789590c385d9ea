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
