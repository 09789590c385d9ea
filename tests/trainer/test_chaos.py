"""Chaos, shortened (benchmarks/chaos_train.py runs the full one): `agent-r1 train` is SIGKILLed in a
rollout, an update and a checkpoint write and resumed after each kill. Every resume starts from the
newest complete checkpoint, no checkpoint is ever corrupt, metrics.jsonl ends with every step once, and
the final weights and AdamW state equal those of an uninterrupted run. Asynchronous RL is held to all
but the equality (timing decides its batches), and to no group lost or trained twice."""

import pytest

from benchmarks.chaos_train import PHASES, Kill, failures, landed_after, print_summary, run_chaos

KILLS, STEPS = 4, 3


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_kills_in_rollout_update_and_checkpoint_writing_resume_exactly(tmp_path, capsys, max_staleness):
    summary = run_chaos(tmp_path / "chaos", KILLS, STEPS, seed=0, reach=0.5, max_staleness=max_staleness)
    with capsys.disabled():
        print_summary(summary)  # which phase each kill hit, shown with -s or on failure
    assert set(PHASES) <= set(summary["phases"]), summary["phases"]
    assert summary["metrics"]["steps"] == list(range(1, STEPS + 1))
    assert failures(summary, KILLS) == []


def test_a_kill_that_came_after_its_phase_is_told_from_one_that_came_early_or_on_time():
    """Such a kill halves the aim at its phase (a loaded machine made the uninterrupted run's phases
    look longer); one inside its phase, or still in start-up, leaves it alone."""
    assert landed_after(Kill(1, "rollout", 2, 0.1, phase="update", step=2))
    assert landed_after(Kill(1, "checkpoint", 2, 0.1, phase="rollout", step=3))
    assert not landed_after(Kill(1, "rollout", 2, 0.1, phase="rollout", step=2))
    assert not landed_after(Kill(1, "update", 2, 0.1, phase="rollout", step=2))
    assert not landed_after(Kill(1, "rollout", 1, 0.1, phase="startup", step=1))
