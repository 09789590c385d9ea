"""Chaos, shortened (benchmarks/chaos_train.py runs the full one): `agent-r1 train` is SIGKILLed in a
rollout, an update and a checkpoint write and resumed after each kill. Every resume starts from the
newest complete checkpoint, no checkpoint is ever corrupt, metrics.jsonl ends with every step once, and
the final weights and AdamW state equal those of an uninterrupted run. Asynchronous RL is held to all
but the equality (timing decides its batches), and to no group lost or trained twice."""

import pytest

from benchmarks.chaos_train import PHASES, failures, print_summary, run_chaos

KILLS, STEPS = 4, 3


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_kills_in_rollout_update_and_checkpoint_writing_resume_exactly(tmp_path, capsys, max_staleness):
    summary = run_chaos(tmp_path / "chaos", KILLS, STEPS, seed=0, reach=0.5, max_staleness=max_staleness)
    with capsys.disabled():
        print_summary(summary)  # which phase each kill hit, shown with -s or on failure
    assert set(PHASES) <= set(summary["phases"]), summary["phases"]
    assert summary["metrics"]["steps"] == list(range(1, STEPS + 1))
    assert failures(summary, KILLS) == []
