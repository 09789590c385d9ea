"""Tool-use demonstrations for the SFT cold start, laid out exactly as a rollout would be.

A demonstration is chat messages: user question, then alternating assistant turns and tool results.
It is turned into `Step`s with the same prompt format, stop conventions and continuation ids the
agent loop produces. A tool-call turn ends at `</tool_call>` (the stop string, no EOS), and the
final answer ends with EOS. The steps are then merged by the RL path's own `merge_trajectory`, so SFT
trains on exactly the masks RL uses.

Sources: GSM8K's `<<expr=result>>` calculator annotations (each becomes a calculator call whose
result comes back as a tool response), and the synthetic word problems of the calculator recipe.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import format_tool_call, format_tool_responses
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.tools.calculator import evaluate, format_number
from agent_r1.types import Message, Step, TrainSequence, Trajectory

_ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]*)>>")
_FINAL = re.compile(r"####\s*(.+)\s*$")


def tool_call_text(expression: str) -> str:
    """The hermes call the model is taught to write for one calculator computation."""
    return format_tool_call("calculator", {"expression": expression})


def calculator_result(expression: str) -> str:
    """What the real calculator tool answers, so demonstrations match what rollouts will see."""
    try:
        return format_number(evaluate(expression))
    except ValueError as exc:
        return f"Error: {exc}"


def gsm8k_demo(question: str, answer: str) -> list[Message]:
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


def calculator_demo(task: dict[str, Any]) -> list[Message]:
    """A synthetic calculator problem solved with one call of its whole expression."""
    result = calculator_result(task["solution"])
    return [
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": tool_call_text(task["solution"])},
        {"role": "user", "content": format_tool_responses([result])},
        {"role": "assistant", "content": f"<answer>{result}</answer>"},
    ]


def demo_to_sequence(
    demo: list[Message], prefix: list[Message], fmt: PromptFormat, tokenizer: PreTrainedTokenizerBase
) -> TrainSequence:
    """One training row of a demonstration: prompt = `prefix` (system, few-shot) + the question.

    The loss mask is 1 on the assistant turns (the tokens the model would sample) and 0 on the
    prompt, chat markup and tool results.
    """
    if len(demo) < 2 or demo[0]["role"] != "user" or demo[-1]["role"] != "assistant":
        raise ValueError("a demonstration is [user, assistant, (tool result, assistant)...]")
    context = fmt.initial([*prefix, demo[0]])
    steps = []
    for k in range(1, len(demo), 2):
        last = k == len(demo) - 1
        ids = tokenizer.encode(demo[k]["content"], add_special_tokens=False)
        if last:
            ids.append(tokenizer.eos_token_id)  # the final answer ends the episode with EOS
        steps.append(Step(list(context), ids, [0.0] * len(ids), index=len(steps)))
        if not last:
            context = context + ids + fmt.continuation([demo[k + 1]], after_eos=False)
    (row,) = merge_trajectory(Trajectory(task={}, traj_id="demo", group_id="demo", steps=steps))
    return row
