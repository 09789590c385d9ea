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
        self._epoch, self._perm = -1, []  # the last epoch's order, computed once (not once per task)

    def take(self, n: int) -> list[dict[str, Any]]:
        out = [self.at(self.cursor + i) for i in range(n)]
        self.cursor += n
        return out

    def at(self, position: int) -> dict[str, Any]:
        """The task drawn at `position` of the order (an asynchronous producer draws by position)."""
        epoch, pos = divmod(position, len(self.tasks))
        return self.tasks[self._order(epoch)[pos]]

    def _order(self, epoch: int) -> list[int]:
        if self._epoch != epoch:
            self._epoch = epoch
            self._perm = random.Random(self.seed * 1_000_033 + epoch).sample(range(len(self.tasks)), len(self.tasks))
        return self._perm
