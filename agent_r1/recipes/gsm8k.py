"""GSM8K with a calculator: grade-school math word problems, answered after calculator calls.

Data: ../shared/data/gsm8k/train.jsonl (the GSM8K train split, MIT). A fixed 10% of problems, chosen
by a stable hash of the question, is the held-out split; the rest is for training. Reward: numeric
match of the final answer with GSM8K's `#### N`.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from agent_r1.data.jsonl import load_tasks
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.recipes.calculator import INSTRUCTIONS, reward
from agent_r1.tools import calculator

DEFAULT_PATH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def is_held_out(question: str) -> bool:
    return int(hashlib.sha256(question.encode()).hexdigest(), 16) % 10 == 0


def final_answer(solution: str) -> float:
    """The number after GSM8K's `####`."""
    return float(solution.rsplit("####", 1)[1].strip().replace(",", ""))


def load(path: str | Path = DEFAULT_PATH, held_out: bool = False, n: int | None = None) -> list[dict[str, Any]]:
    """GSM8K tasks of one split: question, answer (the number), solution (the annotated text)."""
    tasks = []
    for row in load_tasks(path):
        if is_held_out(row["question"]) == held_out:
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
