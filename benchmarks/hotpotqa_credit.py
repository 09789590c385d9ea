"""Trajectory-level GRPO against turn-level credit on HotpotQA: one SFT cold start, one budget, one seed.

    python benchmarks/hotpotqa_credit.py --sft runs/hotpotqa/sft/policy --out runs/hotpotqa-credit \
        [--arms sft,oracle,grpo,gigpo,turn_grpo] [--num-tasks 200] [key=value ...]

Every RL arm trains `recipes/hotpotqa.yaml`'s `rl` section plus the arm's overrides (and any given on
the command line), from the same SFT policy with the same seed, then is evaluated greedily on the first
N dev questions with the recipe's `eval` section. `sft` evaluates the cold start itself; `oracle`
evaluates it with the supporting paragraphs shown beside the question (`task.gold_context`), which
measures reading apart from searching.

Reported per arm: EM and F1 with bootstrap 95% intervals; the paired difference to `sft` with its
interval; each tool's calls per episode; the share of supporting paragraphs read by the end of each
turn; EM among the episodes that read both; how the episodes ended. An arm already evaluated in --out
is not run again (delete its directory to redo it), so arms can run one at a time. An RL arm resumes
from its newest checkpoint: an arm's `rl/` directory copied into a new --out, run with a larger
`rl.steps`, trains it further from where it stopped. `rl.seed=N` runs the RL arms with another seed
(other training questions and samples) from the same cold start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console

from agent_r1.config import load_config
from agent_r1.evaluate import bootstrap_ci, run_eval
from agent_r1.observe.plot import read_metrics
from agent_r1.pipeline import DemoConfig
from agent_r1.tasks.hotpotqa import support_read
from agent_r1.trainer.rl import train
from agent_r1.types import Trajectory

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "hotpotqa.yaml"
ARMS = {
    "sft": None,  # the cold start, evaluated as is
    "oracle": None,  # the cold start with the gold paragraphs in the prompt
    "grpo": [  # every turn: the episode's advantage, from the outcome alone
        "rl.algo.estimator=grpo",
        "rl.task.process_reward=false",
        "rl.task.call_error_reward=0.0",
        "rl.task.format_reward=per_call",
    ],
    "gigpo": [  # + step groups (the recipe's γ 0.95)
        "rl.algo.estimator=gigpo",
        "rl.task.process_reward=false",
        "rl.task.call_error_reward=0.0",
        "rl.task.format_reward=per_call",
    ],
    "turn_grpo": [  # per-turn returns-to-go, with a process reward for each supporting page read
        "rl.algo.estimator=turn_grpo",
        "rl.task.process_reward=true",
        "rl.algo.process_reward_weight=0.2",
        "rl.task.call_error_reward=0.0",
        "rl.task.format_reward=per_call",
    ],
    "turn_grpo_error_cost": [  # the same, and a cost per wrong call: the format reward no longer pays for
        "rl.algo.estimator=turn_grpo",  # open(query=...) -> error -> answer with the title (docs/search.md)
        "rl.task.process_reward=true",
        "rl.algo.process_reward_weight=0.2",
        "rl.task.call_error_reward=-1.0",  # x 0.2 = -0.2 per wrong call: more than its +0.1 format reward
        "rl.task.format_reward=per_call",
    ],
    "turn_grpo_episode_format": [  # the same, with the format reward paid once per answered,
        "rl.algo.estimator=turn_grpo",  # well-formed episode, so calling more earns nothing
        "rl.task.process_reward=true",
        "rl.algo.process_reward_weight=0.2",
        "rl.task.call_error_reward=-1.0",
        "rl.task.format_reward=episode",
    ],
    "grpo_process": [  # GRPO on the same rewards as turn_grpo_episode_format, summed into the episode's
        "rl.algo.estimator=grpo",  # return: the estimator apart from the rewards
        "rl.task.process_reward=true",
        "rl.algo.process_reward_weight=0.2",
        "rl.task.call_error_reward=-1.0",
        "rl.task.format_reward=episode",
    ],
    "turn_grpo_potential": [  # the same, the reading reward as a potential: returns stay the outcome's
        "rl.algo.estimator=turn_grpo",
        "rl.task.process_reward=true",
        "rl.algo.process_reward_weight=0.5",
        "rl.algo.process_reward_potential=true",
        "rl.task.call_error_reward=0.0",
        "rl.task.format_reward=per_call",
    ],
}


def run_arm(name: str, sft: str, out: Path, num_tasks: int, extra: list[str], console: Console) -> dict[str, Any]:
    """Train (RL arms) and evaluate one arm; its per-question scores and diagnostics."""
    overrides = [*(ARMS[name] or []), *extra, f"eval.num_tasks={num_tasks}"]
    if name == "oracle":
        overrides.append("eval.task.gold_context=true")
    cfg = load_config(DemoConfig, str(RECIPE), overrides)
    arm_dir = out / name
    arm_dir.mkdir(parents=True, exist_ok=True)
    model, train_s = sft, 0.0
    if ARMS[name] is not None:
        run_dir = arm_dir / "rl"
        train(dataclasses.replace(cfg.rl, model=sft, run_dir=str(run_dir)), console=console)
        # every step's time, those of a run this one resumed included
        model, train_s = str(run_dir / "policy"), sum(m.get("time/step", 0.0) for m in read_metrics(run_dir))
    # the arm's training resumes where a kill left it, and so does its eval
    ecfg = dataclasses.replace(cfg.eval, model=model, out=str(arm_dir / "eval.jsonl"), resume=True)
    metrics, trajs = run_eval(ecfg, console)
    return {"overrides": overrides, "train_seconds": train_s, "metrics": metrics} | diagnose(trajs, ecfg.max_turns)


def diagnose(trajs: list[Trajectory], max_turns: int) -> dict[str, Any]:
    """Per-question EM / F1 (in task order) and where the episodes went."""
    read_by_turn = [0.0] * max_turns  # mean share of supporting paragraphs read by the end of turn k
    ends: Counter = Counter()
    both, em_both = 0, 0.0
    for t in trajs:
        results: list[dict[str, Any]] = []
        phi = 0.0
        for k in range(max_turns):
            if k < len(t.steps):
                results += t.steps[k].info.get("tool_results", [])
                phi = support_read(t.task, results)
            read_by_turn[k] += phi / len(trajs)
        ends[str(t.termination)] += 1
        if phi == 1.0:
            both += 1
            em_both += t.metrics.get("reward/em", 0.0)
    return {
        "em": [t.metrics.get("reward/em", 0.0) for t in trajs],
        "f1": [t.metrics.get("reward/f1", 0.0) for t in trajs],
        "read_by_turn": read_by_turn,
        "read_both": both / len(trajs),
        "em_when_both_read": em_both / both if both else None,
        "terminations": dict(ends),
    }


def report(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table: EM and F1 with intervals, the difference to the cold start, tool use, reading."""
    base = results.get("sft")
    lines = [
        "| arm | EM [95% CI] | F1 [95% CI] | EM − SFT [95% CI] | F1 − SFT [95% CI] | search / ep | open / ep "
        "| both read | EM when both read | train s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(ci: tuple[float, float, float], scale: float = 100.0, signed: bool = False) -> str:
        m, lo, hi = (scale * v for v in ci)
        return f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}]" if signed else f"{m:.1f} [{lo:.1f}, {hi:.1f}]"

    for name, r in results.items():
        paired = base is not None and name not in ("sft", "oracle") and len(base["em"]) == len(r["em"])
        diff_em = fmt(bootstrap_ci(r["em"], base["em"]), signed=True) if paired else ""
        diff_f1 = fmt(bootstrap_ci(r["f1"], base["f1"]), signed=True) if paired else ""
        m = r["metrics"]
        em_both = f"{100 * r['em_when_both_read']:.1f}" if r["em_when_both_read"] is not None else ""
        lines.append(
            f"| {name} | {fmt(bootstrap_ci(r['em']))} | {fmt(bootstrap_ci(r['f1']))} | {diff_em} | {diff_f1} "
            f"| {m.get('tool_calls/search', 0.0):.2f} | {m.get('tool_calls/open', 0.0):.2f} "
            f"| {100 * r['read_both']:.1f}% | {em_both} | {r['train_seconds']:.0f} |"
        )
    lines.append("")
    lines.append("supporting paragraphs read by the end of turn k (mean share), and how episodes ended:")
    for name, r in results.items():
        by_turn = " ".join(f"{v:.2f}" for v in r["read_by_turn"])
        lines.append(f"- {name}: {by_turn}; {r['terminations']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="the SFT cold start's policy directory")
    parser.add_argument("--out", required=True, help="where each arm's run, eval records and results.json go")
    parser.add_argument("--arms", default="sft,oracle,grpo,gigpo,turn_grpo")
    parser.add_argument("--num-tasks", type=int, default=200)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every arm, e.g. rl.steps=8")
    args = parser.parse_args()
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"unknown arm(s) {unknown}: choose from {', '.join(ARMS)}")
    out, console = Path(args.out), Console()
    path = out / "results.json"
    results: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.is_file() else {}
    for name in arms:
        if name in results:
            console.print(f"{name}: already evaluated in {path}")
            continue
        console.rule(name)
        results[name] = run_arm(name, args.sft, out, args.num_tasks, args.overrides, console)
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
    text = report({k: results[k] for k in ARMS if k in results})
    (out / "results.md").write_text(text + "\n")
    console.print(text)


if __name__ == "__main__":
    main()
