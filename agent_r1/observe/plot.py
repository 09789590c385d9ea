"""`agent-r1 plot RUN_DIR`: the curves a person checks first, as one PNG, from metrics.jsonl."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

Metrics = dict[str, float]

# (title, metric keys drawn on that panel); the first key present is drawn, the rest are fallbacks
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward_mean",)),
    ("accuracy", ("accuracy",)),
    ("turns / episode", ("turns",)),
    ("tool calls / episode", ("tool_calls",)),
    ("tool errors / episode", ("tool_errors",)),
    ("response tokens / episode", ("response_tokens",)),
    ("KL to reference", ("kl", "kl_in_reward")),
    ("entropy", ("entropy",)),
    ("validation accuracy (greedy)", ("val/accuracy",)),
]


@dataclass
class PlotConfig:
    run_dir: str = ""
    """run directory holding metrics.jsonl"""
    out: str | None = None
    """PNG path (default RUN_DIR/plots/curves.png)"""

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("give the run directory: agent-r1 plot RUN_DIR")


def read_metrics(run_dir: str | Path) -> list[Metrics]:
    """Every step's metrics line; a missing file or a broken line is a one-line error."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no metrics file (is {run_dir} a run directory?)")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not a JSON line") from None
    return out


def plot_metrics(history: list[Metrics], path: str | Path, title: str = "") -> Path:
    """One PNG with a panel per entry of PANELS, over RL steps; a metric never logged says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(3, 3, figsize=(12, 8))
    for ax, (name, keys) in zip(axes.flat, PANELS, strict=True):
        key = next((k for k in keys if any(k in m for m in history)), None)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.set_xlabel("RL step")
        if key is None:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        points = [(m["step"], m[key]) for m in history if key in m and math.isfinite(m[key])]
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(cfg: PlotConfig) -> Path:
    out = Path(cfg.out) if cfg.out else Path(cfg.run_dir) / "plots" / "curves.png"
    path = plot_metrics(read_metrics(cfg.run_dir), out, title=str(cfg.run_dir))
    print(f"wrote {path}")
    return path
