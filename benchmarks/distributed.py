"""The calculator RL step on this machine: 1 process, 2 torchrun processes (FSDP2, gloo), and 1 process
with 2 Ray rollout workers; with what the distribution layer itself costs per step.

Each variant is a real `agent-r1 train` run of the bundled model (SmolLM2-135M) for `--steps` steps;
the figures are the medians over the steps after the first (which includes start-up effects).
`algo.zero_variance_groups=keep` makes every step update, whatever the untrained model's rewards.

    python benchmarks/distributed.py [--steps 3] [--tasks 8] [--group 4] [--variants one,torchrun,ray]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = [
    "time/step", "time/rollout", "time/reference", "time/update", "time/weight_sync", "time/gather_trajectories",
    "time/ray_rollout", "time/ray_weights", "ray/weights_mb", "ray/trajectories_mb", "train_tokens", "response_tokens",
]  # fmt: skip


def run(variant: str, args: argparse.Namespace, run_dir: Path) -> dict[str, float]:
    cfg = [
        "model=default", "task=calculator", "task.few_shot=true", f"steps={args.steps}", f"run_dir={run_dir}",
        f"rollout.tasks_per_step={args.tasks}", f"rollout.group_size={args.group}", "rollout.max_new_tokens=64",
        "algo.zero_variance_groups=keep", "save_every=1000", "log.trajectories_every=0",
    ]  # fmt: skip
    train = ["-m", "agent_r1.cli", "train", *cfg]
    if variant == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *train]
    elif variant == "ray":
        cmd = [sys.executable, *train, "cluster.rollout_workers=2"]
    else:
        cmd = [sys.executable, *train]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True)
    wall = time.perf_counter() - t0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    out = {k: statistics.median(s[k] for s in steps) for k in KEYS if all(k in s for s in steps)}
    return out | {"wall_s": wall, "steps_measured": len(steps)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--variants", default="one,torchrun,ray")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            results[variant] = run(variant, args, Path(tmp) / variant)
            print(variant, json.dumps(results[variant]), flush=True)
    print("\n| | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
    for k in ["wall_s", *KEYS]:
        if any(k in r for r in results.values()):
            print(f"| {k} | " + " | ".join(f"{r[k]:.3g}" if k in r else "" for r in results.values()) + " |")


if __name__ == "__main__":
    main()
