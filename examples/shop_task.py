"""A new task in one file: shopping sums with two tools (a price list and a calculator) and a custom reward.

    agent-r1 train task=examples.shop_task task.items=3    # run from the repository root

A task module provides Options, tasks(), make_env() and optionally demos() (agent_r1/task.py).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from agent_r1.data import split_of
from agent_r1.env.tool_calls import ParseError, extract_answer, parse_tool_calls
from agent_r1.env.tool_env import ToolEnv
from agent_r1.rewards import numeric_match
from agent_r1.tools import calculator, tool

PRICES = {"apple": 0.4, "pear": 0.55, "melon": 2.3, "bread": 1.9, "cheese": 4.75, "milk": 1.15}


@dataclass
class Options:
    items: int = 2
    """kinds of item per question"""
    penalty: float = 0.2
    """subtracted from the reward for an answer given without looking up every price"""

    def __post_init__(self) -> None:
        if not 1 <= self.items <= len(PRICES):
            raise ValueError(f"task.items must be in 1..{len(PRICES)}, got {self.items}")


@tool(timeout=1.0)
def price(item: str) -> float:
    """The price of one unit of an item, in euros.

    Args:
        item: the item's name, e.g. apple
    """
    if item not in PRICES:
        raise ValueError(f"unknown item {item!r}; the shop sells {', '.join(PRICES)}")
    return PRICES[item]


def tasks(options: Options, split: str, n: int, seed: int = 0) -> list[dict]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        basket = {item: rng.randint(2, 9) for item in rng.sample(sorted(PRICES), options.items)}
        question = "How much do " + " and ".join(f"{k} {item}s" for item, k in basket.items()) + " cost?"
        if split_of(question) == split:
            out.append({"question": question, "answer": round(sum(PRICES[i] * k for i, k in basket.items()), 2),
                        "items": sorted(basket)})  # fmt: skip
    return out


def reward(task: dict, responses: list[str], penalty: float = 0.2) -> tuple[float, dict[str, float]]:
    """Exact total in the last response, minus `penalty` when some price was never looked up (a guess)."""
    answer = extract_answer(responses[-1]) if responses else None
    correct = numeric_match(answer, task["answer"]) if answer is not None else 0.0
    calls = [c for r in responses for c in parse_tool_calls(r) if not isinstance(c, ParseError)]
    asked = {c.arguments.get("item") for c in calls if c.name == "price" and isinstance(c.arguments, dict)}
    looked_up = float(set(task["items"]) <= asked)
    return correct - penalty * (1.0 - looked_up), {"correct": correct, "looked_up": looked_up}


def make_env(options: Options, prompt_format, max_turns: int = 4) -> ToolEnv:
    return ToolEnv(
        {"price": price, "calculator": calculator}, prompt_format, functools.partial(reward, penalty=options.penalty),
        instructions="Look up each price, add up with the calculator, give the total in <answer></answer>.",
        max_turns=max_turns, reward_on="episode",
    )  # fmt: skip
