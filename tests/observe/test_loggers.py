"""JSONL always; TensorBoard and W&B (offline) through their own libraries, read back from disk."""

import json
import math

from agent_r1.observe.loggers import LogConfig, Loggers

STEPS = [{"reward_mean": 0.123457, "accuracy": 0.5, "loss": math.nan}, {"reward_mean": 0.654321, "accuracy": 0.75}]


def log_two_steps(cfg: LogConfig, run_dir) -> None:
    loggers = Loggers(cfg, run_dir, {"seed": 7})
    for step, m in enumerate(STEPS, 1):
        loggers.log({"step": step, **m}, step)
    loggers.close()


def test_jsonl_keeps_every_value(tmp_path):
    log_two_steps(LogConfig(), tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["reward_mean"] == 0.654321
    assert math.isnan(lines[0]["loss"])  # kept for the health checks
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_two_steps(LogConfig(tensorboard=True), tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward_mean", "accuracy"}  # NaN loss dropped, not plotted as 0
    got = [(e.step, round(e.value, 6)) for e in events.Scalars("reward_mean")]
    assert got == [(1, 0.123457), (2, 0.654321)]


def test_wandb_offline_run_is_written_locally(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    log_two_steps(LogConfig(wandb=True, wandb_project="agent-r1-test"), tmp_path)
    wandb.teardown()  # finish() can return before W&B's service process has written the file
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # `wandb sync` uploads this later
    data = run.read_bytes()
    assert b"reward_mean" in data and b"0.654321" in data and b"agent-r1-test" in data
