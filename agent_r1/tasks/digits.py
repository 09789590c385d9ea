"""Digits: a vision task. A picture shows two handwritten two-digit numbers; the answer is their product.

The pictures are composed from scikit-learn's `load_digits` (1,797 handwritten 8x8 digits, shipped with
the package, no download): the first number's two digits on the top row, the second's on the bottom row,
a 16x16 grey picture. The question comes with a low-resolution *overview* of it (each digit averaged
into 2x2 blocks of 4x4 pixels, where even a tuned classifier reads about half the digits right), and
the agent has two tools:

    zoom()                    the picture at full resolution (a tool result that is an image)
    calculator(expression)    the product (a 135M model cannot multiply two-digit numbers in its head)

Reading the overview and multiplying gets the answer only by luck; zooming first reads the digits.
`zoom_share` of the SFT demonstrations zoom (the others read the overview), so the cold start teaches
the format and both tools, and RL is left to find out that zooming pays.

Splits: every digit image belongs to one split by a stable hash of its index (agent_r1.data.splits),
and a picture is drawn only from digit images of its own split, so held-out pictures show handwriting
that training never saw. Tasks are JSON: the pictures travel as PNG data URLs.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from agent_r1.data.digits import draw, overview, picture
from agent_r1.data.splits import Split
from agent_r1.env.base import Env, StepResult
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import format_tool_call, format_tool_responses
from agent_r1.env.tool_env import ToolEnv
from agent_r1.models.vision import png_data_url
from agent_r1.tasks import calculator as arithmetic
from agent_r1.tools import Tool, ToolResult, calculator, tool
from agent_r1.types import Action, Message, Observation


@dataclass
class Options:
    zoom_share: float = 0.3
    """share of the SFT demonstrations that zoom before multiplying (the rest read the overview)"""
    format_weight: float = 0.0
    """weight of the answer-format check added to the outcome reward"""

    def __post_init__(self) -> None:
        if not 0.0 <= self.zoom_share <= 1.0:
            raise ValueError(f"task.zoom_share must be in [0, 1], got {self.zoom_share}")


INSTRUCTIONS = (
    "The picture shows two numbers, one on each row. Multiply them: use the calculator for the product, "
    "then give the final number inside <answer></answer>. The picture is small; zoom shows it at full resolution."
)
QUESTION = "What is the product of the two numbers in the picture?"
ZOOMED = "The picture at full resolution:"


def make_task(rng: random.Random, split: Split) -> dict[str, Any]:
    """Two numbers 10-99 written with digit images of `split`: the task (question, answer, the digit
    image indices, the full picture as a data URL, and the message that shows its overview)."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    index = draw(rng, [int(c) for c in f"{a}{b}"], split)
    full = picture(index)
    shown = png_data_url(overview(full))
    return {
        "question": QUESTION,
        "answer": a * b,
        "numbers": [a, b],
        "digit_images": index,
        "picture": png_data_url(full),
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": shown}, {"type": "text", "text": QUESTION}]}
        ],
    }


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` pictures of a split, deterministic in `seed` (and disjoint handwriting across splits)."""
    rng = random.Random(f"digits/{split}/{seed}")
    return [make_task(rng, split) for _ in range(n)]


def zoom_tool(shown: dict[str, Any]) -> Tool:
    """`zoom()`: the current episode's picture at full resolution (`shown["picture"]`, set on reset)."""

    @tool
    def zoom() -> ToolResult:
        """Show the picture at full resolution."""
        return ToolResult(ZOOMED, images=[shown["picture"]])

    return zoom


class DigitsEnv(Env):
    """A ToolEnv whose zoom tool shows the episode's own picture: `reset` hands the task's picture to
    the tool, everything else is the ToolEnv's."""

    def __init__(self, env: ToolEnv, shown: dict[str, Any]) -> None:
        self.env, self.shown = env, shown

        self.stop = env.stop

    async def reset(self, task: dict[str, Any]) -> Observation:
        self.shown["picture"] = task["picture"]
        return await self.env.reset(task)

    async def step(self, action: Action) -> StepResult:
        return await self.env.step(action)

    async def close(self) -> None:
        await self.env.close()

    def __getattr__(self, name: str) -> Any:  # format, prompt_prefix, tools, ...
        return getattr(self.env, name)


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 4) -> DigitsEnv:
    shown: dict[str, Any] = {}
    env = ToolEnv(
        {"zoom": zoom_tool(shown), "calculator": calculator},
        prompt_format,
        functools.partial(arithmetic.reward, format_weight=options.format_weight),  # the exact product
        instructions=INSTRUCTIONS,
        max_turns=max_turns,
    )
    return DigitsEnv(env, shown)


def demos(options: Options, env: Any, n: int, seed: int = 0) -> list[list[Message]]:
    """`n` training pictures solved; a `zoom_share` of them zoom first (chosen by a seeded draw)."""
    rng = random.Random(seed)
    return [demo(t, zoom=rng.random() < options.zoom_share) for t in tasks(options, "train", n, seed)]


def demo(task: dict[str, Any], zoom: bool) -> list[Message]:
    """The episode: [zoom, see the full picture,] then the calculator task's own demonstration of the
    product (the call, the real tool's answer, the final answer)."""
    a, b = task["numbers"]
    messages: list[Message] = list(task["messages"])
    if zoom:
        shown = format_tool_responses([ZOOMED], [[task["picture"]]])
        messages += [{"role": "assistant", "content": format_tool_call("zoom", {})}, {"role": "user", "content": shown}]
    return [*messages, *arithmetic.demo({"question": QUESTION, "solution": f"{a} * {b}"})[1:]]
