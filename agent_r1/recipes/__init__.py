"""Task recipes: each is a task source, an env with its tools, and a reward, in one short file.

`tasks_and_env` is the one place the entry points (train, eval) pick a recipe by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from agent_r1.data import Split, load_tasks
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.recipes import calculator, gsm8k, hotpotqa

Recipe = Literal["calculator", "gsm8k", "hotpotqa"]


def recipe_tasks(
    recipe: Recipe, *, split: Split, n: int, seed: int = 0, ops: tuple[int, ...] = (1, 2), data: str | None = None
) -> list[dict[str, Any]]:
    """The first `n` tasks of one split (a `data` jsonl overrides the recipe's source)."""
    if recipe == "hotpotqa":
        return hotpotqa.load(data, split=split, n=n)
    if data:
        return load_tasks(data)[:n]
    if recipe == "gsm8k":
        return gsm8k.load(split=split, n=n)
    return calculator.make_tasks(n, seed=seed, ops=ops, split=split)


def tasks_and_env(
    recipe: Recipe,
    fmt: PromptFormat,
    *,
    split: Split,
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
    """Tasks of one split (see `recipe_tasks`) and the env factory."""
    tasks = recipe_tasks(recipe, split=split, n=n, seed=seed, ops=ops, data=data)
    if recipe == "hotpotqa":
        index = hotpotqa.retriever_for(retriever, extra=[data] if data else [])
        return tasks, lambda: hotpotqa.make_env(fmt, index, max_turns, max_tool_tokens)
    if recipe == "gsm8k":
        return tasks, lambda: gsm8k.make_env(fmt, max_turns, format_weight)
    return tasks, lambda: calculator.make_env(fmt, max_turns, few_shot, format_weight)
