"""Eval's per-kind accuracy: which kind of task moved, not just the mean."""

import math
import re

import pytest

from agent_r1.evaluate import accuracy_by_kind, bootstrap_ci
from agent_r1.types import Step, Trajectory


def traj(task: dict, correct: float | None, reward: float) -> Trajectory:
    step = Step(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], reward=reward, done=True)
    metrics = {} if correct is None else {"reward/correct": correct}
    return Trajectory(task=task, traj_id="t", group_id="g", steps=[step], metrics=metrics)


def test_accuracy_per_kind_uses_the_correct_part_not_the_format_bonus():
    trajs = [
        traj({"ops": 1}, 1.0, 1.1),
        traj({"ops": 1}, 0.0, 0.1),  # a format bonus alone is not a correct answer
        traj({"ops": 1}, 1.0, 1.1),
        traj({"ops": 2}, 0.0, 0.1),
    ]
    assert accuracy_by_kind(trajs, "ops") == {"accuracy/ops=1": 2 / 3, "accuracy/ops=2": 0.0}


def test_hotpotqa_types_and_rewards_without_a_correct_part():
    trajs = [traj({"type": "bridge"}, None, 1.0), traj({"type": "comparison"}, None, 0.5)]
    assert accuracy_by_kind(trajs, "type") == {"accuracy/type=bridge": 1.0, "accuracy/type=comparison": 0.0}


def test_no_breakdown_unless_every_task_names_its_kind():
    assert accuracy_by_kind([traj({"ops": 1}, 1.0, 1.0), traj({}, 1.0, 1.0)], "ops") == {}
    assert accuracy_by_kind([traj({"ops": 1}, 1.0, 1.0)], None) == {}  # the task names no kind key
    assert accuracy_by_kind([], "ops") == {}


BROKEN_TASK = '''
"""A task whose env fails on every episode (its data service is down, say), or, for the tasks that
BROKEN_TASK_STALL lists, never answers (an environment variable, not an option: a resumed eval must
have the same settings)."""
import asyncio
import os
from dataclasses import dataclass

from agent_r1.env.base import Env


@dataclass
class Options:
    pass


def tasks(options, split, n, seed=0):
    return [{"question": f"q{i}", "answer": i} for i in range(n)]


class Down(Env):

    async def reset(self, task):
        if str(task["answer"]) in os.environ.get("BROKEN_TASK_STALL", "").split(","):
            await asyncio.sleep(3600)
        raise ConnectionError("the data service is down")


def make_env(options, prompt_format, max_turns=4):
    return Down()
'''


def test_eval_reports_errors_and_warns_when_they_dominate(tmp_path, tiny_model_dir, capsys):
    from agent_r1.cli import main

    task = tmp_path / "broken_task.py"
    task.write_text(BROKEN_TASK)
    assert main(["eval", f"model={tiny_model_dir}", f"task={task}", "num_tasks=3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"episodes\s*│\s*3\b", out) and re.search(r"errors\s*│\s*100%", out)  # the table's rows
    assert "warning: 100% of the episodes ended in an error" in out and "the data service is down" in out


LONG_TASK = '''"""A task whose first prompt alone is longer than a small model's context (tau2's telecom on SmolLM2)."""
from dataclasses import dataclass

from agent_r1.env.base import Env
from agent_r1.types import Observation


@dataclass
class Options:
    pass


def tasks(options, split, n, seed=0):
    return [{"question": f"q{i}", "answer": i} for i in range(n)]


class Long(Env):

    async def reset(self, task):
        return Observation(token_ids=[5] * 100_000)


def make_env(options, prompt_format, max_turns=4):
    return Long()
'''


def test_eval_says_how_many_episodes_overflowed_the_context_and_the_remedy(tmp_path, tiny_model_dir, capsys):
    from agent_r1.cli import main

    task = tmp_path / "long_task.py"
    task.write_text(LONG_TASK)
    assert main(["eval", f"model={tiny_model_dir}", f"task={task}", "num_tasks=3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "3 of 3 episodes ended in a context overflow (3 before the model's first turn" in out
    assert "task.context.strategy=truncate|elide|summarize|memory" in out


def test_gsm8k_in_its_published_format_evaluates(tmp_path, tiny_model_dir):
    """`task.data=FILE` with answers ending in `#### 72` is read by the task's own loader: no episode errors."""
    import json

    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, run_eval

    solution = "{n}+{n}=<<{n}+{n}={s}>>{s}\n#### {s:,}"  # GSM8K's layout, with a thousands separator
    rows = [
        {"question": f"Natalia sold {n} clips and then {n} more. How many?", "answer": solution.format(n=n, s=2 * n)}
        for n in range(600, 640)
    ]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(EvalConfig, None, [f"model={tiny_model_dir}", "task=gsm8k", f"task.data={data}", "split=train",
                                         "num_tasks=4", "max_new_tokens=4", "max_turns=1"])  # fmt: skip
    metrics, trajs = run_eval(cfg)
    assert metrics["errors"] == 0.0 and metrics["episodes"] == 4.0
    assert all(t.error is None and t.task["answer"] == 2 * int(t.task["question"].split()[2]) for t in trajs)


def test_bootstrap_interval_matches_the_normal_approximation_and_pairs_by_task():
    hits = [1.0] * 60 + [0.0] * 140  # 30% of 200
    mean, low, high = bootstrap_ci(hits)
    half = 1.96 * math.sqrt(0.3 * 0.7 / 200)  # 0.0635
    assert mean == pytest.approx(0.3) and low == pytest.approx(0.3 - half, abs=0.01)
    assert high == pytest.approx(0.3 + half, abs=0.01)
    # the same 60 hits plus 10 more: the unpaired intervals overlap, the paired one excludes 0
    better = [1.0] * 70 + [0.0] * 130
    assert bootstrap_ci(better)[1] < high
    diff, low, high = bootstrap_ci(better, hits)
    assert diff == pytest.approx(0.05) and 0 < low < 0.05 < high
    shuffled = [1.0] * 10 + [0.0] * 60 + [1.0] * 60 + [0.0] * 70  # 10 gained, 60 swapped, mean +0.05
    diff, low, high = bootstrap_ci(shuffled, hits)
    assert diff == pytest.approx(0.05) and low < 0 < high  # the same mean gain, but it is noise
    assert bootstrap_ci([0.5, 0.5, 0.5]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="pair them by task"):
        bootstrap_ci([1.0, 0.0], [1.0])


def test_eval_config_refuses_an_empty_kv_budget():
    from agent_r1.evaluate import EvalConfig

    with pytest.raises(ValueError, match="kv_cache_gb must be > 0, got 0"):
        EvalConfig(kv_cache_gb=0)


def test_a_context_budget_too_small_for_the_task_stops_eval_in_one_line(tiny_model_dir, capsys):
    from agent_r1.cli import main

    context = ["task.context.strategy=truncate", "task.context.budget=64"]
    args = ["eval", f"model={tiny_model_dir}", "task=dossiers", *context]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [next(line for line in err if "task.context.budget=64 leaves no room" in line)]


def test_a_killed_eval_keeps_the_episodes_it_finished_and_resumes(tmp_path, tiny_model_dir, capsys):
    """Records used to be written only at the end, so a τ² eval killed after an hour kept nothing. Each
    finished episode's record now goes to OUT.partial.jsonl as it ends; a SIGKILL leaves those, whole, and
    `resume=true` runs only the rest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from agent_r1.observe.records import read_records

    (tmp_path / "broken_task.py").write_text(BROKEN_TASK)
    out, partial = tmp_path / "evals" / "run.jsonl.gz", tmp_path / "evals" / "run.partial.jsonl"
    args = [sys.executable, "-m", "agent_r1.cli", "eval", f"model={tiny_model_dir}", "task=broken_task",
            "num_tasks=4", f"out={out}"]  # fmt: skip
    env = os.environ | {
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}",
        "OMP_NUM_THREADS": "1",
        "BROKEN_TASK_STALL": "1,3",
    }
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (partial.is_file() and partial.read_text().count("\n") == 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    kept = list(read_records(partial))
    assert sorted(r["task"]["answer"] for r in kept) == [0, 2]
    assert all("the data service is down" in r["error"] for r in kept) and not out.exists()

    # Run again: refused while the partial file holds work; with resume=true only tasks 1 and 3 run.
    from agent_r1.cli import main

    with open(partial, "a") as f:
        f.write('{"traj_id": "cut-by-the-kill", "ta')  # a record the kill cut short is run again
    again = args[3:]  # eval model=... task=... num_tasks=4 out=..., in this process (where nothing stalls)
    sys.path.insert(0, str(tmp_path))
    try:
        before = partial.read_text()
        assert main(again) == 2 and partial.read_text() == before  # nothing of the earlier eval is lost
        assert "holds 2 finished episodes of an earlier eval: resume=true" in capsys.readouterr().err
        assert main([*again, "resume=true"]) == 0
    finally:
        sys.path.remove(str(tmp_path))
    records = list(read_records(out))
    assert [r["task"]["answer"] for r in records] == [0, 1, 2, 3] and not partial.exists()
    by_answer = {r["task"]["answer"]: r["traj_id"] for r in records}
    assert {by_answer[0], by_answer[2]} == {r["traj_id"] for r in kept}  # the finished ones were not run again
    assert re.search(r"episodes\s*│\s*4\b", " ".join(capsys.readouterr().out.split()))


def test_a_finished_eval_writes_every_record_in_task_order_and_drops_the_partial_file(tmp_path, tiny_model_dir):
    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, run_eval
    from agent_r1.observe.records import read_records

    out = tmp_path / "eval.jsonl"
    cfg = load_config(EvalConfig, None, [f"model={tiny_model_dir}", "task=calculator", "num_tasks=3",
                                         "max_new_tokens=4", "max_turns=1", f"out={out}"])  # fmt: skip
    _, trajs = run_eval(cfg)
    assert [r["task"] for r in read_records(out)] == [t.task for t in trajs] and len(trajs) == 3
    assert not (tmp_path / "eval.partial.jsonl").exists()


def test_a_resumed_eval_takes_whole_groups_by_position_and_refuses_other_settings(tmp_path, capsys):
    import json

    from rich.console import Console

    from agent_r1.evaluate import finished_episodes

    tasks = [{"q": "a", "n": 1.5}, {"q": "b", "n": (1, 2)}, {"q": "c"}, {"q": "b", "n": (1, 2)}]  # b twice
    settings = {"group_size": 2, "seed": 0, "num_tasks": 4}  # (a few of the keys, for the test)

    def rec(position, g, **changed):
        task = json.loads(json.dumps(tasks[position]))  # as it reads back: the tuple is a list
        return {
            "task": task,
            "traj_id": f"{position}{g}",
            "eval": {"sample": position * 2 + g, "settings": settings | changed},
        }

    kept = tmp_path / "run.partial.jsonl"
    # the second b's group is whole (its samples ended out of order), a's was cut short by the kill, c and
    # the first b never ran, and the kill cut a line
    lines = [rec(3, 1), rec(0, 0), rec(3, 0)]
    kept.write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n" + '{"task": {"q": "a"')
    finished = finished_episodes(kept, tasks, settings, True, Console())
    assert {i: [r["traj_id"] for r in g] for i, g in finished.items()} == {3: ["30", "31"]}  # not the first b
    assert "resumed: 1 of 4 tasks finished" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"holds 3 finished episodes of an earlier eval: resume=true"):
        finished_episodes(kept, tasks, settings, False)
    with pytest.raises(ValueError, match=r"run.partial.jsonl:1: made by an eval with group_size=2; resume with"):
        finished_episodes(kept, tasks, settings | {"group_size": 1}, True)
    changed = [*tasks[:3], {"q": "d"}]  # the data behind position 3 changed
    with pytest.raises(ValueError, match=r"run.partial.jsonl: task 3 is not the one this eval reads there"):
        finished_episodes(kept, changed, settings, True)
    kept.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"task": {}, "traj_id": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"run.partial.jsonl:2: not a record of agent-r1 eval; delete the file"):
        finished_episodes(kept, tasks, settings, True)
    kept.write_text(json.dumps(rec(3, 0)) + "\n" + json.dumps(rec(3, 1)) + "\n")  # from before kv_cache_dtype
    assert list(finished_episodes(kept, tasks, settings | {"kv_cache_dtype": "auto"}, True)) == [3]
    with pytest.raises(ValueError, match=r"made by an eval with kv_cache_dtype='auto'; resume with"):
        finished_episodes(kept, tasks, settings | {"kv_cache_dtype": "bf16"}, True)
    kept.write_text("")  # killed before any episode ended: nothing to keep, nothing to refuse
    assert finished_episodes(kept, tasks, settings, False) == {}
    assert finished_episodes(tmp_path / "none.partial.jsonl", tasks, settings, False) == {}


def test_a_resumed_sampled_eval_is_the_whole_run(tmp_path, tiny_model_dir):
    """At temperature 1 with groups of 2, an eval resumed from a partial file holding task 1's group
    samples tasks 0 and 2 exactly as the whole run did (seeded by position), and its metrics count the
    kept group."""
    import json

    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, partial_path, run_eval
    from agent_r1.observe.records import read_records

    def run(out, *extra):
        args = [f"model={tiny_model_dir}", "task=calculator", "num_tasks=3", "group_size=2", "temperature=1.0",
                "max_new_tokens=6", "max_turns=1", f"out={out}", *extra]  # fmt: skip
        return run_eval(load_config(EvalConfig, None, args))[0]

    whole_metrics = run(tmp_path / "whole.jsonl")
    whole = list(read_records(tmp_path / "whole.jsonl"))
    resumed_out = tmp_path / "resumed.jsonl"
    partial_path(resumed_out).write_text("".join(json.dumps(r) + "\n" for r in whole[2:4]))  # task 1's group
    resumed_metrics = run(resumed_out, "resume=true")
    resumed = list(read_records(resumed_out))
    assert [r["traj_id"] for r in resumed[2:4]] == [r["traj_id"] for r in whole[2:4]]  # kept, not run again
    assert [[row["ids"] for row in r["rows"]] for r in resumed] == [[row["ids"] for row in r["rows"]] for r in whole]
    assert whole[0]["rows"][0]["ids"] != whole[1]["rows"][0]["ids"]  # one task's two samples differ: seeding matters
    assert resumed_metrics["accuracy"] == whole_metrics["accuracy"] and resumed_metrics["episodes"] == 6


@pytest.mark.parametrize("value", ["auto", "bf16"])
def test_kv_cache_dtype_reaches_the_engine_and_the_settings_a_resume_checks(value, tiny_model_dir, monkeypatch):
    """`kv_cache_dtype=bf16` stores the eval's keys and values in bf16; it changes the episodes sampled, so a
    resumed eval must share it."""
    import torch

    from agent_r1 import evaluate
    from agent_r1.config import load_config
    from agent_r1.engines.cpu import local_engine

    engines = []

    class Recorded(local_engine.LocalEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(local_engine, "LocalEngine", Recorded)  # what make_engine builds
    args = [f"model={tiny_model_dir}", "num_tasks=2", "max_new_tokens=4", "max_turns=1", f"kv_cache_dtype={value}"]
    cfg = load_config(evaluate.EvalConfig, None, args)
    metrics, _ = evaluate.run_eval(cfg)
    (engine,) = engines
    assert metrics["episodes"] == 2.0 and metrics["errors"] == 0.0
    assert engine._cache.dtype == (torch.bfloat16 if value == "bf16" else torch.float32)
    assert evaluate.eval_settings(cfg)["kv_cache_dtype"] == value
