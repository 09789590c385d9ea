"""Eval's per-kind accuracy: which kind of task moved, not just the mean."""

from agent_r1.evaluate import accuracy_by_kind
from agent_r1.types import Step, Trajectory


def traj(task: dict, correct: float | None, reward: float) -> Trajectory:
    step = Step(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], reward=reward)
    metrics = {} if correct is None else {"reward/correct": correct}
    return Trajectory(task=task, traj_id="t", group_id="g", steps=[step], metrics=metrics)


def test_accuracy_per_kind_uses_the_correct_part_not_the_format_bonus():
    trajs = [
        traj({"ops": 1}, 1.0, 1.1),
        traj({"ops": 1}, 0.0, 0.1),  # a format bonus alone is not a correct answer
        traj({"ops": 1}, 1.0, 1.1),
        traj({"ops": 2}, 0.0, 0.1),
    ]
    assert accuracy_by_kind(trajs, "ops") == {"accuracy/ops=1": 2 / 3, "accuracy/ops=2": 0.0}


def test_hotpotqa_types_and_rewards_without_a_correct_part():
    trajs = [traj({"type": "bridge"}, None, 1.0), traj({"type": "comparison"}, None, 0.5)]
    assert accuracy_by_kind(trajs, "type") == {"accuracy/type=bridge": 1.0, "accuracy/type=comparison": 0.0}


def test_no_breakdown_unless_every_task_names_its_kind():
    assert accuracy_by_kind([traj({"ops": 1}, 1.0, 1.0), traj({}, 1.0, 1.0)]) == {}
    assert accuracy_by_kind([]) == {}
