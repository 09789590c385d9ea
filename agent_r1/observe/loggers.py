"""Metric loggers: JSONL always; TensorBoard and Weights & Biases when the config asks for them.

Each logger is a small object with `log(metrics, step)` and `close()`; `Loggers` fans out to the ones
configured. TensorBoard and W&B are used through their own libraries, so their dashboards, offline
sync (`wandb sync RUN_DIR/wandb/offline-run-*`) and tooling work as users expect.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from agent_r1.utils.jsonl import append_jsonl
from agent_r1.utils.paths import write_text_atomic


@dataclass
class LogConfig:
    tensorboard: bool = False
    """also write TensorBoard event files to RUN_DIR/tensorboard (needs the tensorboard package)"""
    wandb: bool = False
    """also log to Weights & Biases under RUN_DIR/wandb (needs the wandb package)"""
    wandb_project: str = "agent-r1"
    """W&B project name"""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes locally (sync later with `wandb sync`); online needs network and a login"""
    trajectories_every: int = 1
    """write RUN_DIR/trajectories/step_N.jsonl.gz every N steps (0 = never)"""

    def __post_init__(self) -> None:
        if self.trajectories_every < 0:
            raise ValueError(f"log.trajectories_every must be >= 0, got {self.trajectories_every}")


class Logger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class JsonlLogger:
    """RUN_DIR/metrics.jsonl: one fsynced line per step, so a killed run keeps every finished step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate(self, step: int) -> None:
        """Keep the lines of steps <= `step` (all lines go when `step` < 0): a run resumed from its
        checkpoint at `step` redoes the later steps, which must not appear twice. Atomic rewrite."""
        if not self.path.is_file():
            return
        lines = [x for x in self.path.read_text().splitlines() if x.strip()]
        kept = [x for x in lines if _step_of(x) <= step]  # a line cut by the kill has no step: dropped
        if len(kept) != len(lines):
            write_text_atomic(self.path, "".join(x + "\n" for x in kept))

    def log(self, metrics: dict[str, float], step: int) -> None:
        append_jsonl(self.path, {"step": step, **metrics})

    def close(self) -> None:
        pass


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return math.inf


class TensorBoardLogger:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError("log.tensorboard=true needs TensorBoard: pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError("log.wandb=true needs Weights & Biases: pip install wandb") from None
        self.run = wandb.init(
            project=project, dir=str(run_dir), mode=mode, config=config, name=run_dir.name, reinit="finish_previous"
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """Every configured logger; `log` writes one step to all of them."""

    def __init__(self, cfg: LogConfig, run_dir: Path, config: dict[str, Any], keep_until: int | None = None) -> None:
        """`keep_until`: keep the metrics.jsonl lines of steps <= it and drop later ones (None: keep all)."""
        self.jsonl = JsonlLogger(run_dir / "metrics.jsonl")
        if keep_until is not None:
            self.jsonl.truncate(keep_until)
        self.loggers: list[Logger] = [self.jsonl]
        if cfg.tensorboard:
            self.loggers.append(TensorBoardLogger(run_dir / "tensorboard"))
        if cfg.wandb:
            self.loggers.append(WandbLogger(run_dir, cfg.wandb_project, cfg.wandb_mode, config))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """Finite numbers only (dashboards reject NaN/inf; the JSONL keeps them for the health checks)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
