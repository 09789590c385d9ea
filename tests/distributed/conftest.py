"""Helpers for tests that launch real torchrun jobs (gloo on this CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


def launch(args: list[str], nproc: int = 2, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc ARGS` (nproc 1: plain python), from the repository root."""
    cmd = [*TORCHRUN, str(nproc), *args] if nproc > 1 else [sys.executable, *args]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc
