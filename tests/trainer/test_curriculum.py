"""The mastery-gated curriculum: a task option raised as the policy masters each value, kept over a resume."""

from __future__ import annotations

import json

import pytest

from agent_r1.trainer.curriculum import Curriculum, CurriculumConfig
from agent_r1.trainer.rl import train
from tests.trainer.conftest import tiny_model, toy_config

# A task whose items name their level; the env solves levels 0 and 1 and never level 2, so a run that
# climbs shows it in its accuracy: 1 while the curriculum is below 2, 0 once it is there.
LEVELS_TASK = """
from dataclasses import dataclass

from agent_r1.env.base import Env as BaseEnv, StepResult
from agent_r1.types import Observation, Termination


@dataclass
class Options:
    level: int = 0

    def __post_init__(self):
        if not 0 <= self.level <= 2:
            raise ValueError(f"task.level must be 0, 1 or 2, got {self.level}")


def tasks(options, split, n, seed=0):
    return [{"question": f"level {options.level} item {i}", "level": options.level} for i in range(n)]


class Env(BaseEnv):

    async def reset(self, task):
        self.task = task
        return Observation(token_ids=[10 + task["level"], 50, 51])  # ids the tiny model's vocabulary has

    async def step(self, action):
        return StepResult(None, float(self.task["level"] < 2), True, {"termination": Termination.ANSWERED})


def make_env(options, prompt_format, max_turns=4):
    return Env()
"""


def config(tmp_path, *overrides):
    task = tmp_path / "levels_task.py"
    task.write_text(LEVELS_TASK)
    curriculum = ["curriculum.option=level", "curriculum.values=[0,1,2]", "curriculum.window=1"]
    return toy_config(tmp_path, f"task={task}", *curriculum, "rollout.tasks_per_step=2", *overrides)


def accuracies(tmp_path):
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    return [(r["accuracy"], r["curriculum/stage"]) for r in rows if "accuracy" in r]


def test_the_run_climbs_one_value_per_mastered_window_and_stops_at_the_last(tmp_path, tokenizer):
    train(config(tmp_path, "steps=4"), model=tiny_model(), tokenizer=tokenizer)
    # step 1 at level 0 (solved: on to 1), step 2 at level 1 (solved: on to 2), then level 2 (never solved)
    assert accuracies(tmp_path) == [(1.0, 1), (1.0, 2), (0.0, 2), (0.0, 2)]


def test_a_resumed_run_goes_on_at_the_stage_it_had_reached(tmp_path, tokenizer):
    train(config(tmp_path, "steps=2", "save_every=2"), model=tiny_model(), tokenizer=tokenizer)
    train(config(tmp_path, "steps=3", "save_every=2"), model=tiny_model(), tokenizer=tokenizer)
    assert accuracies(tmp_path)[-1] == (0.0, 2)  # level 2 again, not level 0 from the start


def test_a_window_averages_steps_before_moving_on():
    c = Curriculum(CurriculumConfig("ops", ([1], [1, 2]), promote_at=0.75, window=2), _calculator())
    # windows: [1.0] too short, [1.0, 0.4] 0.7, [0.4, 1.0] 0.7, [1.0, 0.6] 0.8 -> on; then a fresh window
    assert [c.update(x) for x in (1.0, 0.4, 1.0, 0.6, 0.9)] == [False, False, False, True, False]
    assert c.stage == 1 and c.task.options.ops == (1, 2) and c.state() == {"stage": 1, "recent": [0.9]}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"option": "ops", "values": ([1],)}, r"curriculum.values needs 2 or more values of task.ops"),
        ({"values": (1, 2)}, "curriculum.option .* is not"),
        ({"option": "ops", "values": ([1], [2]), "promote_at": 0}, r"curriculum.promote_at must be in \(0, 1\]"),
    ],
)
def test_bad_settings_are_one_line_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        CurriculumConfig(**kw)


def test_a_value_the_task_refuses_fails_at_the_start():
    with pytest.raises(ValueError, match=r"curriculum: .*task\.ops"):
        Curriculum(CurriculumConfig("ops", ([1], "many")), _calculator())


def test_the_run_climbs_asynchronously_too_leaving_out_the_old_levels_groups(tmp_path, tokenizer):
    """With max_staleness=1 groups of a level already left may still be running or buffered when the
    curriculum moves on: the producer leaves them out (counted), so a step trains on one level."""
    train(config(tmp_path, "steps=4", "rollout.max_staleness=1"), model=tiny_model(), tokenizer=tokenizer)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["curriculum/stage"] for r in rows] == [1, 2, 2, 2]
    assert [r["accuracy"] for r in rows][:2] == [1.0, 1.0] and rows[-1]["accuracy"] == 0.0
    assert sum(r.get("curriculum/left_out_groups", 0) for r in rows) >= 1


def _calculator():
    from agent_r1.task import TaskSpec

    return TaskSpec("calculator")
