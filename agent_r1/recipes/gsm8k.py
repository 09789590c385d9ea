"""GSM8K with a calculator: grade-school math word problems, answered after calculator calls.

Data: ../shared/data/gsm8k/train.jsonl (the GSM8K train split, MIT), split by a stable hash of the
question into 10% held out (test), 10% validation and 80% train (agent_r1.data.splits). Reward: numeric
match of the final answer with GSM8K's `#### N`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from agent_r1.data.jsonl import load_tasks
from agent_r1.data.splits import Split, split_of
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.recipes.calculator import INSTRUCTIONS, reward
from agent_r1.tools import calculator

DEFAULT_PATH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def final_answer(solution: str) -> float:
    """The number after GSM8K's `####`."""
    return float(solution.rsplit("####", 1)[1].strip().replace(",", ""))


def load(path: str | Path = DEFAULT_PATH, split: Split = "train", n: int | None = None) -> list[dict[str, Any]]:
    """GSM8K tasks of one split: question, answer (the number), solution (the annotated text)."""
    tasks = []
    for row in load_tasks(path):
        if split_of(row["question"]) == split:
            tasks.append(
                {"question": row["question"], "answer": final_answer(row["answer"]), "solution": row["answer"]}
            )
    return tasks[:n] if n is not None else tasks


def make_env(prompt_format: PromptFormat, max_turns: int = 6, format_weight: float = 0.0) -> ToolEnv:
    return ToolEnv(
        {"calculator": calculator},
        prompt_format,
        functools.partial(reward, format_weight=format_weight),
        instructions=INSTRUCTIONS,
        max_turns=max_turns,
    )
