"""Pieces shared by the RL and SFT entry points: the learning-rate schedule and the progress bar."""

from __future__ import annotations

import math
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def lr_schedule(total: int, warmup: int, kind: str) -> Callable[[int], float]:
    """LR multiplier per optimizer step: linear warm-up, then constant, linear or cosine decay to 0."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        frac = min(1.0, (i - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - frac
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0

    return factor


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console
    )
