"""GSM8K with a calculator: grade-school math word problems, answered after calculator calls.

Data: the bundled agent_r1/data/files/gsm8k/train.jsonl (the GSM8K train split, MIT), split by a stable hash of the
question into 10% held out (test), 10% validation and 80% train (agent_r1.data.splits); or any file in
GSM8K's published layout (`task.data=FILE`: question, and an answer that ends in `#### N`), used whole. Reward: numeric
match of the final answer with GSM8K's `#### N`. Demonstrations: each `<<expr=result>>` calculator
annotation of a solution becomes a calculator call whose result comes back as a tool response.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.data.bundled import bundled
from agent_r1.data.jsonl import load_tasks
from agent_r1.data.splits import Split, split_of
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import format_tool_responses
from agent_r1.env.tool_env import ToolEnv
from agent_r1.tasks import calculator
from agent_r1.tasks.calculator import calculator_result, tool_call_text
from agent_r1.types import Message

_ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]*)>>")
_FINAL = re.compile(r"####\s*(.+)\s*$")


@dataclass
class Options:
    data: str | None = None
    """GSM8K-layout jsonl (question, answer ending in `#### N`); None = the bundled GSM8K train split"""
    format_weight: float = 0.0
    """weight of the answer-format check added to the outcome reward"""


def final_answer(solution: str) -> float:
    """The number after GSM8K's `####` (a plain number is taken as it is)."""
    text = solution.rsplit("####", 1)[-1].strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"a GSM8K answer must end in '#### N', got {solution[-40:]!r}") from None


def load(path: str | Path | None = None, split: Split = "train", n: int | None = None) -> list[dict[str, Any]]:
    """GSM8K tasks of one split: question, answer (the number), solution (the annotated text). The bundled
    file is split by question hash; a file given as `path` is used whole, for any split."""
    bucketed = path is None
    path = path or bundled("gsm8k/train.jsonl")
    out = []
    for i, row in enumerate(load_tasks(path), 1):
        if bucketed and split_of(row["question"]) != split:
            continue
        try:
            answer = final_answer(str(row["answer"]))
        except ValueError as exc:
            raise ValueError(f"{path}:{i}: {exc}") from None
        out.append({"question": row["question"], "answer": answer, "solution": str(row["answer"])})
        if n is not None and len(out) == n:
            break
    return out


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    return load(options.data, split=split, n=n)


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 6) -> ToolEnv:
    """The calculator task's env (tool, instructions, reward), without its worked example."""
    return calculator.make_env(
        calculator.Options(few_shot=False, format_weight=options.format_weight), prompt_format, max_turns
    )


def demos(options: Options, env: ToolEnv, n: int, seed: int = 0) -> list[list[Message]]:
    """Demonstrations from the training split; solutions whose annotations disagree with the calculator
    are skipped."""
    out = []
    for task in load(options.data, split="train"):
        try:
            out.append(demo(task["question"], task["solution"]))
        except ValueError:
            continue
        if len(out) == n:
            break
    return out


def demo(question: str, answer: str) -> list[Message]:
    """A GSM8K solution as a multi-turn tool-use episode.

    Text before each `<<expr=result>>` annotation is kept as reasoning in the assistant turn that
    makes the call; the visible result after the annotation starts the next turn. The final turn ends
    with `<answer>N</answer>` from GSM8K's `#### N`.
    """
    final = _FINAL.search(answer)
    if final is None:
        raise ValueError("GSM8K answer has no '#### N' line")
    body = answer[: final.start()].rstrip()
    messages: list[Message] = [{"role": "user", "content": question}]
    pending = ""
    pos = 0
    for m in _ANNOTATION.finditer(body):
        pending += body[pos : m.start()]
        result = calculator_result(m.group(1))
        if result.startswith("Error") or not _same_number(result, m.group(2)):
            raise ValueError(f"annotation <<{m.group(1)}={m.group(2)}>> does not match the calculator ({result})")
        messages.append({"role": "assistant", "content": pending + tool_call_text(m.group(1).strip())})
        messages.append({"role": "user", "content": format_tool_responses([result])})
        pending, pos = "", m.end()
    pending += body[pos:]
    tail = pending.strip()
    answer_text = f"<answer>{final.group(1).strip().replace(',', '')}</answer>"
    messages.append({"role": "assistant", "content": (tail + "\n" if tail else "") + answer_text})
    return messages


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b.replace(",", "").strip())) <= 1e-6 * max(1.0, abs(float(a)))
    except ValueError:
        return False
