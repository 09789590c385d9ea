"""Calculator task: arithmetic word problems the model should solve by calling a calculator.

Numbers are 2–4 digits, large enough that a 135M model cannot do the arithmetic in its head, so the
reward (exact numeric match of the final answer) rewards using the tool. Difficulty = number of
operations (1–3). The splits are disjoint by construction: a problem's split (train, val or test =
held out) is a fixed hash bucket of its text (agent_r1.data.splits), whatever the seed.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from agent_r1.data import load_tasks
from agent_r1.data.splits import Split, split_of
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import extract_answer, format_tool_call, format_tool_responses
from agent_r1.env.tool_env import ToolEnv
from agent_r1.rewards import answer_format, numeric_match
from agent_r1.tools import calculator, check_sandbox, python_tool
from agent_r1.tools.calculator import evaluate, format_number
from agent_r1.types import Message

KIND_KEY = "ops"  # eval reports accuracy per number of operations


@dataclass
class Options:
    ops: tuple[int, ...] = (1, 2)
    """operations per generated problem (1-3), cycled"""
    few_shot: bool = True
    """show one worked tool-use episode before the question"""
    format_weight: float = 0.0
    """weight of the answer-format check added to the outcome reward"""
    data: str | None = None
    """jsonl of tasks (question, answer) instead of generated problems (used whole, for any split)"""
    tool: str = "calculator"
    """what the model computes with: calculator, or python (a sandboxed interpreter per episode)"""
    sandbox: str = "bwrap"
    """the python tool's isolation: bwrap (bubblewrap; an error where it cannot run), or none (resource
    limits only: the model's code can reach the network and write wherever this user can)"""

    def __post_init__(self) -> None:
        if self.tool == "python":
            check_sandbox(self.sandbox)
        if not self.ops or any(o not in (1, 2, 3) for o in self.ops):
            raise ValueError(f"task.ops must be operation counts in 1..3, got {self.ops}")
        if self.tool not in ("calculator", "python"):
            raise ValueError(f"task.tool must be calculator or python, got {self.tool!r}")


INSTRUCTIONS = (
    "Solve the problem. Use the calculator for every computation, then give the final number inside <answer></answer>."
)
PYTHON_INSTRUCTIONS = (
    "Solve the problem. Use python to print every computation, then give the final number inside <answer></answer>."
)

EXAMPLE_TASK = {
    "question": "A shop sells 37 boxes with 24 pens in each box. How many pens does it sell?",
    "solution": "37 * 24",
}


_ITEMS = [
    ("crates", "bottles"),
    ("boxes", "pencils"),
    ("bags", "marbles"),
    ("trucks", "bricks"),
    ("shelves", "books"),
]


def make_problem(rng: random.Random, ops: int) -> dict[str, Any]:
    """One word problem with `ops` operations (1–3) and its exact integer answer."""
    holder, item = rng.choice(_ITEMS)
    a, b = rng.randint(12, 99), rng.randint(13, 97)
    text = f"A warehouse has {a} {holder} with {b} {item} in each."
    answer, expr = a * b, f"{a} * {b}"
    if ops >= 2:
        if rng.random() < 0.5:
            c = rng.randint(101, 999)
            text += f" Then {c} more {item} arrive."
            answer, expr = answer + c, f"{expr} + {c}"
        else:
            c = rng.randint(11, min(999, answer // 2))
            text += f" Then {c} {item} are sold."
            answer, expr = answer - c, f"{expr} - {c}"
    if ops >= 3:
        d = rng.randint(3, 19)
        text += f" The same happens in {d} other warehouses, and in this one too."
        answer, expr = answer * (d + 1), f"({expr}) * {d + 1}"
    return {
        "question": f"{text} How many {item} are there in total?",
        "answer": answer,
        "solution": expr,
        "ops": ops,
    }


def make_tasks(n: int, seed: int = 0, ops: tuple[int, ...] = (1, 2), split: Split = "train") -> list[dict[str, Any]]:
    """`n` problems of one split, deterministic in `seed`; operation counts cycle through `ops`."""
    rng = random.Random(seed)
    tasks: list[dict[str, Any]] = []
    while len(tasks) < n:
        task = make_problem(rng, ops[len(tasks) % len(ops)])
        if split_of(task["question"]) == split:
            tasks.append(task)
    return tasks


def reward(task: dict[str, Any], text: str, format_weight: float = 0.0) -> tuple[float, dict[str, float]]:
    """Exact numeric match of the final answer (the `<answer>` content, else the last number),
    plus `format_weight` x the answer-format check."""
    answer = extract_answer(text)
    correct = numeric_match(answer if answer is not None else text, task["answer"])
    fmt = answer_format(text)
    return correct + format_weight * fmt, {"correct": correct, "format": fmt}


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` tasks of a split: generated problems, or the rows of `options.data`."""
    if options.data:
        return load_tasks(options.data)[:n]
    return make_tasks(n, seed=seed, ops=options.ops, split=split)


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 4) -> ToolEnv:
    """A ToolEnv with the calculator (or a fresh python sandbox), this task's instructions and reward."""
    python = options.tool == "python"
    return ToolEnv(
        {"python": python_tool(isolation=options.sandbox)} if python else {"calculator": calculator},
        prompt_format,
        functools.partial(reward, format_weight=options.format_weight),
        instructions=PYTHON_INSTRUCTIONS if python else INSTRUCTIONS,
        examples=demo(EXAMPLE_TASK, options.tool) if options.few_shot else None,
        max_turns=max_turns,
    )


def demos(options: Options, env: ToolEnv, n: int, seed: int = 0) -> list[list[Message]]:
    """`n` training problems, each solved with one tool call of its whole expression."""
    return [demo(t, options.tool) for t in make_tasks(n, seed=seed, ops=options.ops)]


def demo(task: dict[str, Any], tool: str = "calculator") -> list[Message]:
    """One problem as a demonstration: the call, the real tool's answer, the final answer."""
    result = calculator_result(task["solution"])
    return [
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": tool_call_text(task["solution"], tool)},
        {"role": "user", "content": format_tool_responses([result])},
        {"role": "assistant", "content": f"<answer>{result}</answer>"},
    ]


def tool_call_text(expression: str, tool: str = "calculator") -> str:
    """The hermes call the model is taught to write for one computation: the calculator's expression,
    or python code that prints it (integer arithmetic: python prints what the calculator answers)."""
    if tool == "python":
        return format_tool_call("python", {"code": f"print({expression})"})
    return format_tool_call("calculator", {"expression": expression})


def calculator_result(expression: str) -> str:
    """What the real calculator tool answers, so demonstrations match what rollouts will see."""
    try:
        return format_number(evaluate(expression))
    except ValueError as exc:
        return f"Error: {exc}"


EXAMPLE: list[Message] = demo(EXAMPLE_TASK)  # the worked episode shown before the question (few_shot)
