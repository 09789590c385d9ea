"""The trainer tests' toy task (tests/trainer/conftest.py: reward = share of sampled ids below 32) as
a task module, so that `agent-r1 train` launched by torchrun can run it: task=tests.distributed.lowid_task."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tests.trainer.conftest import LowIdEnv


@dataclass
class Options:
    step_seconds: float = 0.0
    """each env step sleeps this long (a run slow enough to be killed between two checkpoints)"""


class SlowLowIdEnv(LowIdEnv):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def step(self, action):
        time.sleep(self.seconds)  # blocks the loop: the whole step takes turns x seconds
        return await super().step(action)


def tasks(options: Options, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    return [{"ids": [10 + i % 16, 50, 51]} for i in range(n)]


def make_env(options: Options, prompt_format: Any, max_turns: int) -> LowIdEnv:
    return SlowLowIdEnv(options.step_seconds)
