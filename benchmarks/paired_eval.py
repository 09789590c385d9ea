"""Two evals of the same tasks compared: each one's accuracy and the paired difference, with percentile
bootstrap 95% intervals over tasks (agent_r1.evaluate.bootstrap_ci).

    python benchmarks/paired_eval.py runs/reasoning_gym/eval_sft.jsonl runs/reasoning_gym/eval_rl.jsonl

    python benchmarks/paired_eval.py --by category runs/bfcl/default.jsonl runs/bfcl/demo_rl.jsonl

Each file is an eval's trajectory records (`agent-r1 eval out=FILE`, or a demo's eval_*.jsonl); the
tasks are paired by their fields, and a task missing from either file is an error. `--by KEY` adds the
same rows for each value of the tasks' KEY (BFCL's category)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent_r1.evaluate import bootstrap_ci
from agent_r1.observe.records import read_records


def scores(path: Path) -> dict[str, tuple[dict, float]]:
    """Task (as JSON) -> the task and the episode's score (`reward/correct` when the reward has parts, else
    whether the reward reached 1, as eval's `correct`)."""
    out = {}
    for r in read_records(path):
        metrics = r.get("metrics") or {}
        score = float(metrics.get("reward/correct", r["reward"] >= 1.0))
        out[json.dumps(r["task"], sort_keys=True)] = (r["task"], score)
    return out


def report(name: str, before: list[float], after: list[float]) -> dict[str, tuple[float, float, float]]:
    rows = {"before": bootstrap_ci(before), "after": bootstrap_ci(after), "after - before": bootstrap_ci(after, before)}
    print(f"{name}: {len(before)} tasks")
    for row, (mean, low, high) in rows.items():
        print(f"{row:>15}: {100 * mean:+6.1f} points, 95% interval [{100 * low:+.1f}, {100 * high:+.1f}]")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--by", help="also compare within each value of this task field")
    args = parser.parse_args()
    before, after = scores(args.before), scores(args.after)
    if set(before) != set(after):
        raise SystemExit(f"the files hold different tasks ({len(set(before) ^ set(after))} not in both)")
    keys = sorted(before)
    groups = {"all": keys}
    if args.by:
        for k in keys:
            groups.setdefault(f"{args.by}={before[k][0].get(args.by)}", []).append(k)
    results = {}
    for name, ks in groups.items():
        results[name] = report(name, [before[k][1] for k in ks], [after[k][1] for k in ks])
    print(json.dumps({g: {k: list(v) for k, v in rows.items()} for g, rows in results.items()}))


if __name__ == "__main__":
    main()
