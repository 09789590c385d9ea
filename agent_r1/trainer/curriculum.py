"""A mastery-gated curriculum: one task option raised value by value as the policy masters each.

    agent-r1 train task=reasoning_gym curriculum.option=level 'curriculum.values=[0,1,2,3]' \
        curriculum.promote_at=0.8 curriculum.window=2

Training starts on the first value. Once the training episodes' mean correctness over the last `window`
steps reaches `promote_at`, the next value's tasks are drawn. This keeps the batch where the policy
still gets a group-relative signal, as DAPO's dynamic sampling does within a step: a group that always
succeeds (or always fails) has zero advantage under GRPO (Yu et al. 2025, "DAPO"; curricula in that
spirit: Bengio et al. 2009, "Curriculum learning"). The option is any of the task's own
(`task.level` of reasoning-gym, `task.ops` of the calculator): the curriculum only rebuilds the task
with it, so every task gets one without code. Validation stays on the configured task, so the best
step is chosen on one fixed yardstick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent_r1.task import TaskSpec


@dataclass
class CurriculumConfig:
    option: str = ""
    """a task option to raise during the run (task.OPTION, e.g. level); empty: no curriculum"""
    values: tuple[Any, ...] = ()
    """its values, easiest first; the run starts at the first"""
    promote_at: float = 0.8
    """the next value comes once the mean correctness over the last `window` steps reaches this"""
    window: int = 2
    """steps averaged, all at the current value"""

    def __post_init__(self) -> None:
        if self.option and len(self.values) < 2:
            raise ValueError(f"curriculum.values needs 2 or more values of task.{self.option}, got {list(self.values)}")
        if not self.option and self.values:
            raise ValueError("curriculum.values is set but curriculum.option (the task option they are for) is not")
        if not 0 < self.promote_at <= 1 or self.window < 1:
            raise ValueError("curriculum.promote_at must be in (0, 1] and curriculum.window >= 1")


class Curriculum:
    """Where the run is in the curriculum, and whether a step's results move it on."""

    def __init__(self, cfg: CurriculumConfig, task: TaskSpec, state: dict[str, Any] | None = None) -> None:
        self.cfg, self.base = cfg, task
        self.stage: int = (state or {}).get("stage", 0)
        self.recent: list[float] = list((state or {}).get("recent", ()))  # correctness of the last steps
        for value in cfg.values:  # a value the task refuses fails now, not when the run reaches it
            try:
                task.with_options({cfg.option: value})
            except ValueError as exc:
                raise ValueError(f"curriculum: {exc}") from None

    @property
    def value(self) -> Any:
        """The option's value at the current stage."""
        return self.cfg.values[self.stage]

    @property
    def task(self) -> TaskSpec:
        """The task at the current stage's value."""
        return self.base.with_options({self.cfg.option: self.value})

    def update(self, correct: float) -> bool:
        """Record one step's mean correctness; True when the run moves to the next value."""
        self.recent = [*self.recent, correct][-self.cfg.window :]
        mastered = len(self.recent) == self.cfg.window and sum(self.recent) / self.cfg.window >= self.cfg.promote_at
        if mastered and self.stage + 1 < len(self.cfg.values):
            self.stage, self.recent = self.stage + 1, []
            return True
        return False

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps for a resume."""
        return {"stage": self.stage, "recent": list(self.recent)}
