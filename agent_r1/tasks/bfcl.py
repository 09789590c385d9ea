"""The Berkeley Function Calling Leaderboard as a task: its items, scored by BFCL's own checkers (`bfcl-eval`).

    agent-r1 eval task=bfcl 'task.categories=[simple_python,multiple,parallel,multi_turn_base]' num_tasks=200

Categories: the AST ones (simple_python, multiple, parallel, parallel_multiple, irrelevance and the live_
ones: one response, its calls checked against the possible answers) and the multi-turn ones (multi_turn_base,
multi_turn_miss_param, multi_turn_long_context: user turns, calls run on BFCL's simulated backends, the
end state checked). Eval reports accuracy per category. BFCL is a benchmark: every split is the same
items. It runs in its own small venv, made once on first use (agent_r1/env/bfcl.py says why).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from agent_r1.data.splits import Split
from agent_r1.env.bfcl import BfclEnv, check_category, worker
from agent_r1.env.prompt_format import PromptFormat

KIND_KEY = "category"  # eval's accuracy per category


@dataclass
class Options:
    categories: list[str] = field(default_factory=lambda: ["simple_python"])
    """BFCL's categories, their items interleaved: simple_python, multiple, parallel, parallel_multiple,
    irrelevance, live_* and multi_turn_base, multi_turn_miss_param, multi_turn_long_context"""
    python: str | None = None
    """a python with bfcl-eval installed; none: agent-r1's own small venv for it, made on first use"""
    timeout_s: float = 30.0
    """the longest one request to BFCL (a call, a check) may take; past it the episode errors and BFCL's
    worker is restarted"""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"task.timeout_s must be > 0, got {self.timeout_s}")
        self.categories = ["simple_python" if c == "simple" else c for c in self.categories]
        if not self.categories:
            raise ValueError("task.categories is empty")
        for category in self.categories:
            check_category(category)


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` items, taken from each category in turn (so n = 4 × 50 is 50 of each of four); the
    same for every split, in BFCL's order (`seed` changes nothing)."""
    bfcl = worker(options.python, options.timeout_s)
    ids = [[{"category": c, "id": i} for i in bfcl.request("items", category=c)["ids"]] for c in options.categories]
    mixed = (item for group in itertools.zip_longest(*ids) for item in group if item is not None)
    return list(itertools.islice(mixed, n))


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 20) -> BfclEnv:
    return BfclEnv(prompt_format, worker(options.python, options.timeout_s), max_turns=max_turns)
