"""`agent-r1 plot` draws a run's curves from metrics.jsonl (a small fake run)."""

import json

import matplotlib.image

from agent_r1.cli import main


def fake_run(run_dir, steps: int = 6) -> None:
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            m = {"step": s, "reward_mean": s / steps, "accuracy": s / (2 * steps), "turns": 2.0, "tool_calls": 1.0}
            m |= {"tool_errors": 0.1, "response_tokens": 40.0 + s, "entropy": 0.8 - 0.05 * s}  # no KL logged
            f.write(json.dumps(m) + "\n")


def test_plot_writes_a_png_of_every_panel(tmp_path, capsys):
    fake_run(tmp_path / "run")
    assert main(["plot", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "plots" / "curves.png"
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (1200, 800)
    assert str(png) in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "run"), f"out={tmp_path / 'other.png'}"]) == 0
    assert (tmp_path / "other.png").stat().st_size > 10_000


def test_plot_of_a_directory_without_metrics_is_a_one_line_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "metrics.jsonl: no metrics file" in err


def test_plot_needs_a_run_dir(capsys):
    assert main(["plot"]) == 2
    assert "agent-r1 plot RUN_DIR" in capsys.readouterr().err
