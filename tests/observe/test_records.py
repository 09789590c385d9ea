"""Trajectory records: turns as a person reads them, rows exactly as the trainer saw them."""

import gzip
import json

import pytest
import torch
from PIL import Image as PILImage

from agent_r1.models.vision import read_image
from agent_r1.observe.records import (
    read_records,
    step_files,
    step_path,
    trajectory_from_record,
    trajectory_records,
    write_records,
)
from agent_r1.rollout.agent_loop import correct, summarize
from agent_r1.types import Image, Step, Termination, Trajectory
from tests.conftest import picture


def two_turn_trajectory(tokenizer, rewrite: bool = False, images: bool = False) -> Trajectory:
    """Question -> tool call -> tool result -> answer; with `rewrite` the env rebuilt the second prompt;
    with `images` a picture comes with the question and another with the tool result."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    p1, r1, obs, r2 = enc("What is 12*7?"), enc(" call calc"), enc(" result: 84"), enc(" answer 84")
    p2 = (enc("Summary: 12*7") if rewrite else p1 + r1) + obs
    result = {"name": "calculator", "arguments": {"expression": "12*7"}, "output": "84", "error": None}
    steps = [
        Step(p1, r1, [-0.5] * len(r1), None, {"tool_calls": 1, "tool_results": [result]}, " call calc", 0, "stop"),
        Step(p2, r2, [-0.25] * len(r2), 1.0, {"tool_calls": 0}, " answer 84", 1, "eos"),
    ]
    if images:
        a, b = (Image(str(s), {}, 0, [], PILImage.fromarray(picture(s, (40, 300)))) for s in (1, 2))
        steps[0].images, steps[1].images = [a], [a, b]
    return Trajectory({"question": "What is 12*7?", "answer": "84"}, "g1-0", "g1", steps, Termination.ANSWERED)


def test_turns_show_only_what_entered_the_context(tokenizer):
    traj = two_turn_trajectory(tokenizer)
    (rec,) = trajectory_records([traj], tokenizer, step=3)
    assert rec["step"] == 3 and rec["reward"] == 1.0 and rec["termination"] == "answered"
    t0, t1 = rec["turns"]
    assert t0["observation"] == "What is 12*7?" and t0["response"] == " call calc"
    assert t1["observation"] == " result: 84"  # only the tool result is new in the second prompt
    assert not t1["rewritten"] and t1["finish_reason"] == "eos" and t1["reward"] == 1.0
    assert t0["tool_results"][0]["output"] == "84" and "tool_results" not in t0["info"]


def test_each_turn_shows_the_pictures_that_entered_with_it(tokenizer):
    (rec,) = trajectory_records([two_turn_trajectory(tokenizer, images=True)], tokenizer)
    first, second = ([read_image(u) for u in t["images"]] for t in rec["turns"])
    assert len(first) == len(second) == 1  # the question's picture is not shown again with the tool result
    assert first[0].size == (256, 34)  # a thumbnail of the 300x40 picture, aspect kept
    assert first[0].tobytes() != second[0].tobytes()
    (plain,) = trajectory_records([two_turn_trajectory(tokenizer)], tokenizer)
    assert [t["images"] for t in plain["turns"]] == [[], []]


def test_rows_are_token_exact_with_advantages(tokenizer):
    traj = two_turn_trajectory(tokenizer)
    s0, s1 = traj.steps
    ids = s1.prompt_ids + s1.response_ids  # the merged row: step 2's prompt extends step 1's context
    p0, r0, r1 = len(s0.prompt_ids), len(s0.response_ids), len(s1.response_ids)
    n_obs = len(s1.prompt_ids) - p0 - r0  # the tool result's tokens
    adv = torch.tensor([0.0] * p0 + [0.5] * r0 + [0.0] * n_obs + [-0.5] * r1)
    (rec,) = trajectory_records([traj], tokenizer, advantages=[[adv]])
    (row,) = rec["rows"]
    assert row["ids"] == ids and "".join(row["tokens"]) == tokenizer.decode(ids)
    assert n_obs == len(tokenizer(" result: 84", add_special_tokens=False)["input_ids"])
    assert row["mask"] == [0] * p0 + [1] * r0 + [0] * n_obs + [1] * r1
    assert row["logprobs"] == [0.0] * p0 + [-0.5] * r0 + [0.0] * n_obs + [-0.25] * r1
    assert row["advantages"] == adv.tolist()
    assert [t["advantage"] for t in rec["turns"]] == [0.5, -0.5]


def test_rewritten_context_starts_a_new_row(tokenizer):
    (rec,) = trajectory_records([two_turn_trajectory(tokenizer, rewrite=True)], tokenizer)
    assert len(rec["rows"]) == 2 and rec["rows"][0]["advantages"] is None
    assert rec["turns"][1]["rewritten"] and rec["turns"][1]["observation"].startswith("Summary")


@pytest.mark.parametrize("rewrite", [False, True])
def test_a_record_gives_back_its_trajectory_steps_and_metrics(tokenizer, rewrite):
    """A resumed eval counts a killed run's episodes from their records: each step's ids, log-probs,
    reward, text and info must come back as they were, whether the steps shared a row or not."""
    traj = two_turn_trajectory(tokenizer, rewrite=rewrite)
    traj.metrics = {"reward/correct": 1.0, "tool_calls": 1.0}
    traj.steps[1].done = True
    (rec,) = json.loads(json.dumps(trajectory_records([traj], tokenizer)))  # as read back from a file
    back = trajectory_from_record(rec)
    for key in ("task", "traj_id", "group_id", "termination", "metrics", "error"):
        assert getattr(back, key) == getattr(traj, key)
    fields = ("prompt_ids", "response_ids", "response_logprobs", "reward", "info", "text", "index", "finish_reason")
    for a, b in zip(back.steps, traj.steps, strict=True):
        assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    assert [s.done for s in back.steps] == [False, True] and back.outcome == 1.0 and correct(back) == 1.0
    assert summarize([back]) == summarize([traj])


def test_write_read_roundtrip_and_step_files(tmp_path, tokenizer):
    records = trajectory_records([two_turn_trajectory(tokenizer)], tokenizer, step=2)
    for step in (2, 10):
        write_records(step_path(tmp_path, step), records)
    assert list(step_files(tmp_path)) == [2, 10]
    path = step_path(tmp_path, 2)
    with gzip.open(path, "rt") as f:  # really gzip, and nothing half-written left beside it
        assert f.read().count("\n") == 1
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []
    assert list(read_records(path)) == records
    plain = write_records(tmp_path / "eval.jsonl", records)
    assert list(read_records(plain)) == records


def test_broken_record_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"traj_id": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON record"):
        list(read_records(bad))
