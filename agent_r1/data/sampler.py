"""The order in which training tasks are drawn: epoch-wise shuffles, resumable from one number."""

from __future__ import annotations

import random
from typing import Any


class TaskSampler:
    """Epoch-wise shuffled task order; `cursor` (tasks consumed) is all a resume needs."""

    def __init__(self, tasks: list[dict[str, Any]], seed: int) -> None:
        if not tasks:
            raise ValueError("the task has no training tasks")
        self.tasks, self.seed, self.cursor = tasks, seed, 0

    def take(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.cursor, len(self.tasks))
            order = random.Random(self.seed * 1_000_033 + epoch).sample(range(len(self.tasks)), len(self.tasks))
            out.append(self.tasks[order[pos]])
            self.cursor += 1
        return out
