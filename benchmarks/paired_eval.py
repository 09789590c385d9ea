"""Two evals of the same tasks compared: each one's accuracy and the paired difference, with percentile
bootstrap 95% intervals over tasks (agent_r1.evaluate.bootstrap_ci).

    python benchmarks/paired_eval.py runs/reasoning_gym/eval_sft.jsonl runs/reasoning_gym/eval_rl.jsonl

Each file is an eval's trajectory records (`agent-r1 eval out=FILE`, or a demo's eval_*.jsonl); the
tasks are paired by their question, and a task missing from either file is an error."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent_r1.evaluate import bootstrap_ci
from agent_r1.observe.records import read_records


def scores(path: Path) -> dict[str, float]:
    """Question -> the episode's task score (`reward/correct` when the reward has parts, else the reward)."""
    out = {}
    for r in read_records(path):
        metrics = r.get("metrics") or {}
        out[r["task"]["question"]] = float(metrics.get("reward/correct", r["reward"] >= 1.0))  # as eval's `correct`
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    before, after = scores(args.before), scores(args.after)
    if set(before) != set(after):
        raise SystemExit(f"the files hold different tasks ({len(set(before) ^ set(after))} not in both)")
    questions = sorted(before)
    b, a = [before[q] for q in questions], [after[q] for q in questions]
    rows = {"before": bootstrap_ci(b), "after": bootstrap_ci(a), "after - before": bootstrap_ci(a, b)}
    print(f"{len(questions)} tasks")
    for name, (mean, low, high) in rows.items():
        print(f"{name:>15}: {100 * mean:+6.1f} points, 95% interval [{100 * low:+.1f}, {100 * high:+.1f}]")
    print(json.dumps({k: list(v) for k, v in rows.items()}))


if __name__ == "__main__":
    main()
