"""The coding task: generated repositories whose test fails on the bug and passes after the fix, a reward that
runs the test sandboxed over what the agent left (its edits to the test do not count), episodes through the real
mini-swe-agent, and SFT that replays its demonstrations through the harness."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agent_r1.data.splits import split_of
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.tasks import coding
from agent_r1.types import Action, Step, Trajectory

OPTIONS = coding.Options()


def fix_by_hand(task: dict, directory: str) -> None:
    """The task's fix, applied as a person would: its one changed line."""
    path = Path(directory) / task["fix"]["path"]
    source = path.read_text()
    assert source.count(task["fix"]["old"]) == 1
    path.write_text(source.replace(task["fix"]["old"], task["fix"]["new"]))


def test_tasks_are_deterministic_of_every_kind_and_split_by_the_hash_of_their_question():
    train, again = coding.make_tasks(24, seed=3), coding.make_tasks(24, seed=3)
    test = coding.make_tasks(12, seed=3, split="test")
    assert train == again and {t["bug"] for t in train} == set(coding.KINDS)
    assert all(split_of(t["question"]) == "train" for t in train) and all(
        split_of(t["question"]) == "test" for t in test
    )
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert {t["bug"] for t in coding.make_tasks(6, kinds=("index",))} == {"index"}
    with pytest.raises(ValueError, match="unknown kind"):
        coding.Options(kinds=("typo",))


@pytest.mark.parametrize("kind", list(coding.KINDS))
def test_the_test_fails_on_the_bug_and_passes_after_the_fix(kind, tmp_path):
    (task,) = coding.make_tasks(1, seed=1, kinds=(kind,))
    coding.prepare(task, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(task["files"])
    assert not coding.passes(task, str(tmp_path))  # under bubblewrap
    subprocess.run(["python3", task["test"]], cwd=tmp_path, capture_output=True)  # caches the buggy bytecode
    fix_by_hand(task, str(tmp_path))  # same size as the bug for most kinds: a stale cache would hide the fix
    assert coding.passes(task, str(tmp_path))


def test_editing_the_test_gains_nothing_and_the_tests_run_sandboxed(tmp_path):
    (task,) = coding.make_tasks(1, seed=2)
    coding.prepare(task, str(tmp_path))
    (tmp_path / task["test"]).write_text("print('OK')\n")  # the agent "fixes" the test instead
    assert not coding.passes(task, str(tmp_path))
    # the module is the agent's code: under bubblewrap it sees none of this user's home and no network
    module = tmp_path / task["fix"]["path"]
    fix_by_hand(task, str(tmp_path))
    home = os.path.realpath(Path.home())
    python = {os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix)}
    # what stays visible of the home: the Python installation, when it lives there (bound back, read-only)
    kept = {name for name in os.listdir(home) if any(p.startswith(os.path.join(home, name) + os.sep) for p in python)}
    assert set(os.listdir(home)) - kept  # there is something to hide
    probe = f"import os, socket\nassert set(os.listdir({home!r})) <= {kept!r}, os.listdir({home!r})\n"
    probe += "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    raise SystemExit(3)\n"
    probe += "except OSError:\n    pass\n"
    module.write_text(probe + module.read_text())
    assert coding.passes(task, str(tmp_path))


async def episode(task: dict, commands: list[str], tokenizer) -> Trajectory:
    """One episode through mini-swe-agent with the policy's answers scripted as bash calls."""
    env = coding.make_env(OPTIONS, ChatFormat(tokenizer), max_turns=4)
    traj = Trajectory(task, "t", "g")
    obs = await env.reset(task)
    try:
        for command in commands:
            text = env.format.tool_format.format_call("bash", {"command": command})
            ids = tokenizer.encode(text, add_special_tokens=False)
            result = await env.step(Action(ids, [0.0] * len(ids), text, "stop"))
            traj.steps.append(
                Step(obs.token_ids, ids, [0.0] * len(ids), result.reward, result.info, text, len(traj.steps))
            )
            traj.steps[-1].done = result.done
            obs = result.observation
    finally:
        await env.close()
    return traj


def test_an_episode_through_mini_swe_agent_is_rewarded_by_the_tests(tokenizer):
    (task,) = coding.make_tasks(1, seed=5)
    fix = task["fix"]
    sed = f"s/{coding._sed(fix['old'])}/{coding._sed(fix['new'], replacement=True)}/"
    fixed = asyncio.run(episode(task, [f"sed -i {shlex.quote(sed)} {fix['path']}", coding.SUBMIT], tokenizer))
    assert (
        fixed.steps[-1].done and fixed.steps[-1].reward == 1.0 and fixed.steps[-1].info["reward_parts"]["correct"] == 1
    )
    assert len(merge_trajectory(fixed)) == 1  # mini-swe-agent sends its history back as it got it: one row
    # the question reached the harness; the fix and the test's expectations did not (they stay with the reward)
    first = tokenizer.decode(fixed.steps[0].prompt_ids)
    assert task["question"] in first and fix["new"] not in first
    lazy = asyncio.run(episode(task, [f"cat {fix['path']}", coding.SUBMIT], tokenizer))
    assert lazy.steps[-1].done and lazy.steps[-1].reward == 0.0


def test_sft_replays_the_demonstrations_through_the_harness(tiny_model, tokenizer, tmp_path):
    import copy

    from agent_r1.models.loading import load_model
    from agent_r1.task import TaskSpec
    from agent_r1.trainer.sft import SFTConfig, demo_rows, sft

    spec = TaskSpec.from_raw({"name": "coding"}, "task", TaskSpec("coding"))
    cfg = SFTConfig(task=spec, num_examples=1, epochs=1, batch_size=1, run_dir=str(tmp_path), device="cpu")
    make_env = lambda: coding.make_env(OPTIONS, ChatFormat(tokenizer), 8)  # noqa: E731
    rows = demo_rows(cfg, make_env(), make_env)
    assert len(rows) == 1  # one row per demonstration: the harness's own prompts, token for token
    for row, task in zip(rows, coding.make_tasks(1), strict=True):
        text = tokenizer.decode(row.input_ids)
        assert task["question"] in text and '"output": "OK\\n"' in text  # the fixed test ran, in the harness
        trained = tokenizer.decode([i for i, m in zip(row.input_ids, row.loss_mask, strict=True) if m])
        assert task["fix"]["path"] in trained and coding.SUBMIT in trained and "returncode" not in trained
    # the whole of `agent-r1 sft task=coding`, to the exported policy
    history = sft(cfg, model=copy.deepcopy(tiny_model), tokenizer=tokenizer)
    assert len(history) == 1 and history[0]["loss"] > 0
    policy, _ = load_model(str(tmp_path / "policy"))
    assert policy.config.vocab_size == tiny_model.config.vocab_size
