"""reasoning-gym as a task family: any of its procedural generators, or a weighted mix of them.

reasoning-gym (`pip install reasoning-gym`) generates items (question, answer, metadata) from a seed
and scores an answer with each generator's own `score_answer`, which is this task's reward. Its
difficulty settings come from a generator's config (`task.config`) or from its curriculum at a level
(`task.level`). A mix is reasoning-gym's own composite dataset. The model may call the calculator or a
sandboxed python (`task.tool`), or no tool. The splits are disjoint as the calculator task's are: an
item's split is a fixed hash bucket of its question (agent_r1.data.splits).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agent_r1.data.splits import Split, split_of
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import extract_answer, format_tool_call, format_tool_responses
from agent_r1.env.tool_env import ToolEnv
from agent_r1.rewards import answer_format
from agent_r1.tasks.calculator import calculator_result
from agent_r1.tools import calculator, check_sandbox, python_tool
from agent_r1.types import Message

KIND_KEY = "dataset"  # eval reports accuracy per generator
INSTALL = "pip install reasoning-gym==0.1.25"
TOOLS = ("calculator", "python", "none")


@dataclass
class Options:
    datasets: tuple[str, ...] = ("chain_sum", "products")
    """reasoning-gym generators (`leg_counting`, `gcd`, ...); several make a mix"""
    weights: tuple[float, ...] = ()
    """the mix's weight of each generator (default: equal)"""
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    """a generator's settings, e.g. {products: {min_digits: 2, max_digits: 3}}; over its curriculum level"""
    level: int | None = None
    """every generator's curriculum at this global level (0 = easiest); None: each generator's defaults"""
    tool: str = "calculator"
    """calculator, python (a sandboxed interpreter per episode) or none"""
    format_weight: float = 0.0
    """weight of the answer-format check added to the reward"""
    sandbox: str = "bwrap"
    """the python tool's isolation: bwrap (bubblewrap; an error where it cannot run), or none (resource
    limits only)"""

    def __post_init__(self) -> None:
        if self.tool == "python":
            check_sandbox(self.sandbox)
        known = _generators()
        if not self.datasets or (bad := [d for d in self.datasets if d not in known]):
            raise ValueError(f"unknown reasoning-gym dataset(s) {bad or []}: choose from {', '.join(sorted(known))}")
        if self.weights and (len(self.weights) != len(self.datasets) or min(self.weights) <= 0):
            raise ValueError(f"task.weights must be {len(self.datasets)} positive numbers, one per dataset")
        if extra := sorted(set(self.config) - set(self.datasets)):
            raise ValueError(f"task.config names {extra}, which are not among task.datasets {list(self.datasets)}")
        if self.tool not in TOOLS:
            raise ValueError(f"task.tool must be one of {', '.join(TOOLS)}, got {self.tool!r}")
        if self.level is not None and self.level < 0:
            raise ValueError(f"task.level must be >= 0, got {self.level}")


INSTRUCTIONS = {
    "calculator": "Solve the problem. Use the calculator for every computation, then give the final answer "
    "inside <answer></answer>.",
    "python": "Solve the problem. Use python to print every computation, then give the final answer inside "
    "<answer></answer>.",
    "none": "Solve the problem, then give the final answer inside <answer></answer>.",
}


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(f"the reasoning_gym task needs reasoning-gym: {INSTALL}") from None
    return reasoning_gym


@functools.cache
def _generators() -> frozenset[str]:
    return frozenset(_reasoning_gym().factory.DATASETS)


def _settings(options: Options, name: str) -> dict[str, Any]:
    """A generator's config: its curriculum at `level` (where it has one), then `config`'s settings."""
    from reasoning_gym.factory import create_curriculum, has_curriculum

    settings: dict[str, Any] = {}
    if options.level is not None and has_curriculum(name):
        curriculum = create_curriculum(name)
        for attr, definition in curriculum.attributes.items():  # past an attribute's last level: its last
            curriculum.set_attr_level(attr, min(options.level, len(definition.levels) - 1))
        config = curriculum.generate_configuration()
        settings = {k: v for k, v in vars(config).items() if k not in ("seed", "size")}
    return settings | options.config.get(name, {})


def generate(options: Options, size: int, seed: int) -> Iterator[dict[str, Any]]:
    """Up to `size` items of the mix, deterministic in `seed`, made as they are read (reasoning-gym's own
    generators and composite)."""
    rg = _reasoning_gym()
    if len(options.datasets) == 1:
        name = options.datasets[0]
        dataset = rg.create_dataset(name, size=size, seed=seed, **_settings(options, name))
    else:
        from reasoning_gym.composite import DatasetSpec

        weights = options.weights or (1.0,) * len(options.datasets)
        specs = [DatasetSpec(n, w, _settings(options, n)) for n, w in zip(options.datasets, weights, strict=True)]
        dataset = rg.create_dataset("composite", size=size, seed=seed, datasets=specs)
    for entry in dataset:
        yield {
            "question": entry["question"],
            "answer": str(entry["answer"]),
            "dataset": entry["metadata"]["source_dataset"],
            "metadata": entry["metadata"],
        }


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` distinct items of a split, each kept in its question's split (10% each for val and
    test). A generator with few distinct questions may give fewer than `n`."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for task in generate(options, 12 * n + 64, seed):
        if split_of(task["question"]) == split and task["question"] not in seen:
            seen.add(task["question"])
            out.append(task)
            if len(out) == n:
                break
    return out


def reward(task: dict[str, Any], text: str, format_weight: float = 0.0) -> tuple[float, dict[str, float]]:
    """reasoning-gym's own score of the `<answer>` content (of the whole response without one), plus
    `format_weight` x the answer-format check."""
    from reasoning_gym import get_score_answer_fn

    answer = extract_answer(text)
    entry = {"question": task["question"], "answer": task["answer"], "metadata": task["metadata"]}
    try:
        score = float(get_score_answer_fn(task["dataset"])(answer if answer is not None else text, entry))
    except Exception:  # a generator's scorer that trips over a malformed answer scores it 0
        score = 0.0
    fmt = answer_format(text)
    return score + format_weight * fmt, {"correct": score, "format": fmt}


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 4) -> ToolEnv:
    python = {"python": python_tool(isolation=options.sandbox)} if options.tool == "python" else {}
    tools = {"calculator": {"calculator": calculator}, "python": python, "none": {}}[options.tool]
    return ToolEnv(
        tools,
        prompt_format,
        functools.partial(reward, format_weight=options.format_weight),
        instructions=INSTRUCTIONS[options.tool],
        max_turns=max_turns,
    )


def demos(options: Options, env: ToolEnv, n: int, seed: int = 0) -> list[list[Message]]:
    """`n` training items solved: with the tool, an item whose metadata holds the expression (the
    arithmetic generators) is one call of it; every other item is answered directly."""
    return [demo(t, options.tool) for t in tasks(options, "train", n, seed)]


def demo(task: dict[str, Any], tool: str = "calculator") -> list[Message]:
    messages: list[Message] = [{"role": "user", "content": task["question"]}]
    expression = str(task["metadata"].get("expression", ""))
    if tool != "none" and expression and calculator_result(expression) == task["answer"]:
        name, args = (
            ("calculator", {"expression": expression})
            if tool == "calculator"
            else ("python", {"code": f"print({expression})"})
        )
        messages += [
            {"role": "assistant", "content": format_tool_call(name, args)},
            {"role": "user", "content": format_tool_responses([task["answer"]])},
        ]
    return [*messages, {"role": "assistant", "content": f"<answer>{task['answer']}</answer>"}]
