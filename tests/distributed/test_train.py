"""`agent-r1 train` under torchrun (2 gloo processes): the same run as one process, a kill between
checkpoints resumed to the same end, a checkpoint resharded onto 3 processes, a dead rank ends the job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from agent_r1.cli import main
from tests.distributed.conftest import ROOT, TORCHRUN, launch
from tests.trainer.conftest import tiny_model

TRAIN = [
    "-m", "agent_r1.cli", "train", "task=tests.distributed.lowid_task", "prompt_format=chat", "save_every=1",
    "optim.lr=1e-2", "rollout.tasks_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
]  # fmt: skip


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory, tokenizer) -> Path:
    """The toy task's 64-id model with the real tokenizer, as a Hugging Face directory."""
    out = tmp_path_factory.mktemp("toy")
    tiny_model(seed=0).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def train_args(toy_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*TRAIN, f"model={toy_dir}", f"run_dir={run_dir}", *extra]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def max_rel_diff(a: Path, b: Path) -> float:
    """Largest relative difference of two policies' weights (run directories or policy directories)."""
    a, b = (p / "policy" if (p / "policy").is_dir() else p for p in (a, b))
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).norm() / y[k].norm()) for k in x)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, toy_dir) -> Path:
    """A 5-step run of the toy task on 2 gloo processes."""
    run = tmp_path_factory.mktemp("two") / "run"
    launch(train_args(toy_dir, run, "steps=5"), nproc=2)
    return run


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, toy_dir) -> Path:
    """The same run in one process."""
    run = tmp_path_factory.mktemp("one") / "run"
    launch(train_args(toy_dir, run, "steps=5"), nproc=1)
    return run


def test_two_processes_train_the_single_process_run(tmp_path, two_process_run, one_process_run):
    """Same seeds per trajectory, rows split between the ranks, gradients summed: the 2-rank run samples
    the same episodes and ends at the same weights (to fp32 rounding of 5 Adam steps)."""
    one, two = metrics(one_process_run), metrics(two_process_run)
    assert [m["step"] for m in two] == [1, 2, 3, 4, 5]
    assert all(m["updates"] == 1 for m in two)
    for a, b in zip(one, two, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["train_tokens"] == b["train_tokens"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert max_rel_diff(one_process_run, two_process_run) < 1e-4
    # `agent-r1 export` reassembles the sharded checkpoint in one process: the policy rank 0 exported
    assert main(["export", str(two_process_run), "--out", str(tmp_path / "exported")]) == 0
    assert max_rel_diff(tmp_path / "exported", two_process_run / "policy") == 0.0
    state = json.loads((two_process_run / "checkpoints" / "step_000005" / "meta.json").read_text())
    assert state["world_size"] == 2
    assert sorted(p.name for p in (two_process_run / "checkpoints" / "step_000005" / "state").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp",
    ]  # fmt: skip  # one shard file per rank


def test_two_processes_with_ray_rollout_workers_train_the_same_run(tmp_path, toy_dir):
    """Rank 0 drives 2 Ray workers and broadcasts their trajectories: the in-process run's episodes."""
    launch(train_args(toy_dir, tmp_path / "one", "steps=2"), nproc=1)
    launch(train_args(toy_dir, tmp_path / "ray", "steps=2", "cluster.rollout_workers=2"), nproc=2)
    one, ray = metrics(tmp_path / "one"), metrics(tmp_path / "ray")
    assert [m["reward_mean"] for m in ray] == [m["reward_mean"] for m in one]
    assert all(m["ray/weights_mb"] > 0 and m["ray/lost_episodes"] == 0 for m in ray)
    assert max_rel_diff(tmp_path / "one", tmp_path / "ray") < 1e-4


def _children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in kids.read_text().split()] if kids.exists() else []


def _run_until(args: list[str], ready: Path, timeout: float = 240) -> subprocess.Popen:
    """Start `torchrun ARGS` in its own process group and return once `ready` exists."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [*TORCHRUN, "2", *args], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.05)
    return proc


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its ranks (which run in sessions of their own)."""
    for pid in [*_children(proc.pid), proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.wait()


def test_a_killed_two_process_run_resumes_from_its_sharded_checkpoint_and_ends_the_same(
    tmp_path, toy_dir, two_process_run
):
    """Killed mid-step 3 and resumed, the run ends as the uninterrupted one (whose env steps did not sleep:
    the sleep changes nothing else)."""
    slow = ["steps=5", "task.step_seconds=0.4"]  # ~1 s per step: a kill lands between two checkpoints
    run = tmp_path / "killed"
    proc = _run_until(train_args(toy_dir, run, *slow), run / "checkpoints" / "step_000002" / "meta.json")
    _kill_job(proc)  # torchrun and both ranks, mid-step 3
    done = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert done and done[-1] < "step_000005", done  # really killed before the end
    resumed = launch(train_args(toy_dir, run, *slow), nproc=2)
    assert "resumed from" in resumed.stdout + resumed.stderr
    whole, again = metrics(two_process_run), metrics(run)
    assert [m["step"] for m in again] == [1, 2, 3, 4, 5]  # no step twice, none missing
    for a, b in zip(whole, again, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["train_tokens"] == b["train_tokens"]
    assert max_rel_diff(two_process_run, run) < 1e-6


def test_a_sharded_checkpoint_resumes_on_three_processes_and_not_on_one(
    tmp_path, toy_dir, two_process_run, one_process_run
):
    """DCP reshards the 2-rank checkpoint of step 4 (weights and AdamW state) onto 3 ranks; the 5th step
    is the one a single process takes. One process cannot read it: one line says how to resume."""
    run = tmp_path / "run"
    shutil.copytree(two_process_run, run)
    for done in (run / "checkpoints" / "step_000005", run / "policy"):  # the run as it stood after step 4
        shutil.rmtree(done)
    proc = launch(train_args(toy_dir, run, "steps=5"), nproc=1, check=False)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert "written by 2 training process(es), this run has 1: resume it under torchrun" in line
    launch(train_args(toy_dir, run, "steps=5"), nproc=3)
    one, three = metrics(one_process_run), metrics(run)
    assert [m["step"] for m in three] == [1, 2, 3, 4, 5]
    assert three[-1]["reward_mean"] == one[-1]["reward_mean"] and three[-1]["updates"] == 1
    assert max_rel_diff(one_process_run, run) < 1e-4
    meta = json.loads((run / "checkpoints" / "step_000005" / "meta.json").read_text())
    assert meta["world_size"] == 3


def test_a_rank_that_dies_ends_the_job_naming_it_and_keeps_the_checkpoints(tmp_path, toy_dir):
    run = tmp_path / "run"
    proc = _run_until(
        train_args(toy_dir, run, "steps=50", "task.step_seconds=0.4"), run / "checkpoints" / "step_000001"
    )
    ranks = _children(proc.pid)  # torchrun's children are the ranks
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)  # torchrun stops rank 0 too: no hang
    finally:
        if proc.poll() is None:
            _kill_job(proc)
    assert proc.returncode != 0
    assert "rank      : 1" in err and "Signal 9" in err
    meta = json.loads((run / "checkpoints" / "step_000001" / "meta.json").read_text())
    assert meta["step"] == 1 and meta["world_size"] == 2  # what was saved is whole
    assert not list((run / "checkpoints").glob("step_*[!0-9]*"))


def test_dist_reports_the_failing_rank_and_step(capsys):
    from agent_r1.distributed.group import Dist

    with pytest.raises(RuntimeError), Dist(rank=1, world=2).failure_report() as report:
        report.step = 7
        raise RuntimeError("CUDA out of memory")
    assert capsys.readouterr().err.strip() == "rank 1 failed at step 7: RuntimeError: CUDA out of memory"


@pytest.mark.parametrize("workers", [[], ["cluster.rollout_workers=2"]])
def test_two_processes_train_asynchronously_from_rank_0s_producer(tmp_path, toy_dir, workers):
    """rollout.max_staleness=1 under torchrun: rank 0's producer rolls out (in its process, or on Ray
    workers) beside the update and broadcasts each batch, both ranks update on it, and the job's
    checkpoint keeps the producer's state."""
    run = tmp_path / "async"
    launch(train_args(toy_dir, run, "steps=6", "rollout.max_staleness=1", *workers), nproc=2)
    hist = metrics(run)
    assert [m["step"] for m in hist] == [1, 2, 3, 4, 5, 6]
    assert all(m["async/version_lag_max"] <= 1 and m["trained_episodes"] == 16 and m["updates"] == 1 for m in hist)
    assert any(m["async/version_lag_mean"] > 0 for m in hist[1:])  # it ran ahead of the update
    meta = json.loads((run / "checkpoints" / "step_000006" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["producer"]["cursor"] == meta["cursor"] >= 6 * 4
