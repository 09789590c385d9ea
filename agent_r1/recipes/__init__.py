"""Task recipes: each is a task source, an env with its tools, and a reward, in one short file.

`tasks_and_env` is the one place the entry points (train, eval) pick a recipe by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from agent_r1.data import load_tasks
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.recipes import calculator, gsm8k, hotpotqa

Recipe = Literal["calculator", "gsm8k", "hotpotqa"]


def tasks_and_env(
    recipe: Recipe,
    fmt: PromptFormat,
    *,
    held_out: bool,
    n: int,
    seed: int = 0,
    ops: tuple[int, ...] = (1, 2),
    data: str | None = None,
    max_turns: int = 4,
    few_shot: bool = False,
    format_weight: float = 0.0,
    retriever: str = "bm25",
    max_tool_tokens: int = 256,
) -> tuple[list[dict[str, Any]], Callable[[], ToolEnv]]:
    """Tasks of one split (a `data` jsonl overrides the recipe's source) and the env factory."""
    if recipe == "hotpotqa":
        tasks = hotpotqa.load(data, held_out=held_out, n=n)
        index = hotpotqa.retriever_for(retriever, extra=[data] if data else [])
        return tasks, lambda: hotpotqa.make_env(fmt, index, max_turns, max_tool_tokens)
    if recipe == "gsm8k":
        tasks = load_tasks(data)[:n] if data else gsm8k.load(held_out=held_out, n=n)
        return tasks, lambda: gsm8k.make_env(fmt, max_turns, format_weight)
    tasks = load_tasks(data)[:n] if data else calculator.make_tasks(n, seed=seed, ops=ops, held_out=held_out)
    return tasks, lambda: calculator.make_env(fmt, max_turns, few_shot, format_weight)
