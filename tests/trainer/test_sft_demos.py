"""Demonstrations become rows with exactly the rollout layout and masks."""

import json

import pytest

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.tasks import calculator
from agent_r1.tasks.calculator import demo as calculator_demo
from agent_r1.tasks.gsm8k import demo as gsm8k_demo
from agent_r1.trainer.sft import demo_to_sequence

NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def call(expr):
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) + "\n</tool_call>"


def test_two_annotations_become_two_tool_calls():
    demo = gsm8k_demo("How many clips?", NATALIA)
    assert demo == [
        {"role": "user", "content": "How many clips?"},
        {"role": "assistant", "content": "Natalia sold 48/2 = " + call("48/2")},
        {"role": "user", "content": "<tool_response>\n24\n</tool_response>"},
        {"role": "assistant", "content": "24 clips in May.\nNatalia sold 48+24 = " + call("48+24")},
        {"role": "user", "content": "<tool_response>\n72\n</tool_response>"},
        {"role": "assistant", "content": "72 clips altogether in April and May.\n<answer>72</answer>"},
    ]


def test_annotation_that_disagrees_with_the_calculator_is_rejected():
    with pytest.raises(ValueError, match="does not match"):
        gsm8k_demo("q", "It is 2+2 = <<2+2=5>>5.\n#### 5")
    with pytest.raises(ValueError, match="####"):
        gsm8k_demo("q", "no final line")


def test_exact_token_masks(tokenizer):
    fmt = ChatFormat(tokenizer)
    prefix = [{"role": "system", "content": "sys"}]
    demo = gsm8k_demo("How many clips?", NATALIA)
    row = demo_to_sequence(demo, prefix, fmt, tokenizer)
    sampled = [tokenizer.encode(demo[k]["content"]) for k in (1, 3, 5)]
    sampled[-1] = [*sampled[-1], tokenizer.eos_token_id]  # the final answer ends with EOS
    # the trainable tokens are exactly the three assistant turns, in order
    trainable = [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert trainable == [t for s in sampled for t in s]
    # everything else is the rollout's prompt: the rendered conversation, tool results included
    prompt_ids = fmt.initial([*prefix, demo[0]])
    assert row.input_ids[: len(prompt_ids)] == prompt_ids and not any(row.loss_mask[: len(prompt_ids)])
    text = tokenizer.decode(row.input_ids)
    full = tokenizer.apply_chat_template([*prefix, *demo], tokenize=False)
    assert text == full.rstrip("\n")  # the same conversation the chat template renders
    assert row.step_index.count(-1) == len(row.input_ids) - sum(len(s) for s in sampled)


def test_calculator_demo_matches_the_task():
    task = calculator.make_tasks(1, ops=(2,))[0]
    demo = calculator_demo(task)
    assert demo[1]["content"] == call(task["solution"])
    assert demo[2]["content"] == f"<tool_response>\n{task['answer']}\n</tool_response>"
    assert demo[3]["content"] == f"<answer>{task['answer']}</answer>"
