from agent_r1.recipes import calculator as recipe
from agent_r1.tools.calculator import evaluate


def test_problems_are_deterministic_and_correct():
    a = recipe.make_tasks(30, seed=5, ops=(1, 2, 3))
    assert a == recipe.make_tasks(30, seed=5, ops=(1, 2, 3))
    assert a != recipe.make_tasks(30, seed=6, ops=(1, 2, 3))
    for task in a:
        assert evaluate(task["solution"]) == task["answer"] > 0  # an independent computation
    assert [t["ops"] for t in a[:3]] == [1, 2, 3]


def test_held_out_split_is_disjoint_from_training():
    train = {t["question"] for s in range(5) for t in recipe.make_tasks(200, seed=s)}
    held_out = {t["question"] for t in recipe.make_tasks(200, held_out=True)}
    assert not train & held_out


def test_reward_is_exact_numeric_match_plus_optional_format():
    task = {"answer": 1234}
    assert recipe.reward(task, "so 1,234") == (1.0, {"correct": 1.0, "format": 0.0})
    assert recipe.reward(task, "<answer>1234</answer> not 5") == (1.0, {"correct": 1.0, "format": 1.0})
    assert recipe.reward(task, "<answer>1233</answer>", format_weight=0.1) == (0.1, {"correct": 0.0, "format": 1.0})
    assert recipe.reward(task, "none")[0] == 0.0


def test_split_membership_follows_the_bucket():
    assert all(recipe.is_held_out(t["question"]) for t in recipe.make_tasks(20, held_out=True))
    assert not any(recipe.is_held_out(t["question"]) for t in recipe.make_tasks(20))
