"""The digits vision task: pictures of held-out handwriting, a blurry overview, a zoom tool whose result is
the episode's own picture, and demonstrations laid out as rollouts."""

import numpy as np
import pytest

from agent_r1.data.digits import digit_images, overview
from agent_r1.data.splits import split_of
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.env.tool_calls import format_tool_call, parse_tool_calls
from agent_r1.models.vision import read_image
from agent_r1.tasks import digits
from agent_r1.types import Action


def test_pictures_show_the_numbers_in_handwriting_of_their_own_split():
    images, labels, _ = digit_images()
    for split in ("train", "test"):
        for t in digits.tasks(digits.Options(), split, 20, seed=1):
            a, b = t["numbers"]
            assert t["answer"] == a * b and 10 <= a <= 99 and 10 <= b <= 99
            assert [int(labels[i]) for i in t["digit_images"]] == [int(c) for c in f"{a}{b}"]
            assert {split_of(f"digits/{i}") for i in t["digit_images"]} == {split}
            full = np.asarray(read_image(t["picture"]).convert("L"))
            assert full.shape == (16, 16)
            top_left = 255 - images[t["digit_images"][0]] * 255 / 16
            assert np.abs(full[:8, :8] - top_left).max() <= 0.5  # the first digit, dark on light
    assert digits.tasks(digits.Options(), "test", 5, 0) == digits.tasks(digits.Options(), "test", 5, 0)
    assert digits.tasks(digits.Options(), "test", 5, 0) != digits.tasks(digits.Options(), "test", 5, 1)


def test_the_overview_averages_each_4x4_block():
    full = np.arange(256, dtype=np.uint8).reshape(16, 16)
    small = overview(full)
    assert small[0, 0] == small[3, 3] == round(full[:4, :4].mean())
    assert small[12, 12] == round(full[12:, 12:].mean()) and len(np.unique(small)) == 16


async def test_zoom_shows_the_episode_picture(tiny_llava):
    env = digits.make_env(digits.Options(), prompt_format_for(tiny_llava[1]), max_turns=4)
    t1, t2 = digits.tasks(digits.Options(), "test", 2, 0)
    for task in (t1, t2):
        obs = await env.reset(task)
        assert len(obs.images) == 1  # the overview
        text = format_tool_call("zoom", {})
        ids = env.format.tokenizer.encode(text, add_special_tokens=False)
        obs, _, done, info = await env.step(Action(ids, [0.0] * len(ids), text))
        assert not done and info["tool_errors"] == {} and len(obs.images) == 2
        assert obs.images[1].digest == env.format.encoder.encode(task["picture"]).digest


@pytest.mark.parametrize("zoom", [True, False])
def test_demonstrations_call_the_tools_the_task_has(zoom, tiny_llava):
    task = digits.tasks(digits.Options(), "train", 1, 0)[0]
    demo = digits.demo(task, zoom=zoom)
    calls = [
        parse_tool_calls(m["content"])[0] for m in demo if m["role"] == "assistant" and "<tool_call>" in m["content"]
    ]
    a, b = task["numbers"]
    assert [c.name for c in calls] == (["zoom"] if zoom else []) + ["calculator"]
    assert calls[-1].arguments == {"expression": f"{a} * {b}"} and demo[-1]["content"] == f"<answer>{a * b}</answer>"
    env = digits.make_env(digits.Options(), prompt_format_for(tiny_llava[1]))
    assert env.reward_fn(task, demo[-1]["content"])[0] == 1.0 and env.reward_fn(task, "<answer>1</answer>")[0] == 0.0
    shares = [sum(len(d) == 6 for d in digits.demos(digits.Options(zoom_share=s), None, 40)) for s in (0.0, 1.0)]
    assert shares == [0, 40]
    with pytest.raises(ValueError, match="zoom_share"):
        digits.Options(zoom_share=1.5)
