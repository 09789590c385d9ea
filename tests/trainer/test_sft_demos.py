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


def test_sft_on_pictures_trains_the_vision_tower_and_exports_the_processor(tiny_llava, tmp_path):
    """A demonstration that zooms holds two pictures (the overview and the tool's); SFT's gradient
    reaches the vision tower, at its own learning rate, and the exported policy loads back as a VLM."""
    import copy

    from agent_r1.env.prompt_format import prompt_format_for
    from agent_r1.models.loading import load_model, load_processor
    from agent_r1.task import TaskSpec
    from agent_r1.tasks import digits
    from agent_r1.trainer.sft import SFTConfig, sft

    model, processor = tiny_llava
    model = copy.deepcopy(model)
    fmt = prompt_format_for(processor)
    env = digits.make_env(digits.Options(), fmt)
    task = digits.tasks(digits.Options(), "train", 1)[0]
    seq = demo_to_sequence(digits.demo(task, zoom=True), env.prompt_prefix, fmt, processor.tokenizer)
    assert len(seq.images) == 2 and seq.input_ids.count(fmt.encoder.image_token_id) == 8
    assert sum(seq.loss_mask) > 0 and all(
        m == 0 for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if i == fmt.encoder.image_token_id
    )

    tower = {n: p.detach().clone() for n, p in model.named_parameters() if "vision_tower" in n}
    text = model.get_input_embeddings().weight.detach().clone()
    spec = TaskSpec.from_raw({"name": "digits", "zoom_share": 1.0}, "task", TaskSpec("digits"))
    cfg = SFTConfig(
        task=spec, num_examples=4, epochs=1, batch_size=4, lr=1e-6, vision_lr=1e-2, run_dir=str(tmp_path), device="cpu"
    )
    sft(cfg, model=model, tokenizer=processor)
    moved = max((p - tower[n]).abs().max().item() for n, p in model.named_parameters() if "vision_tower" in n)
    assert moved > 1e-3 > (model.get_input_embeddings().weight - text).abs().max().item()  # 1e-2 vs 1e-6
    policy, _ = load_model(str(tmp_path / "policy"))
    assert type(policy).__name__ == "LlavaForConditionalGeneration"
    assert type(load_processor(str(tmp_path / "policy"))).__name__ == "LlavaProcessor"
