"""The calculator demo's RL stage through the gateway, against the built-in task, from the same cold start.

`examples/calculator_agent.py` is the calculator task written as an agent program of one's own (the
OpenAI SDK; the program runs the tool). This script trains it with `task=gateway` from a demo run's SFT
policy, with the demo's RL settings and the same training problems in the same order (the built-in
task's 4,096 generated train problems, written as the gateway's jsonl), then evaluates it greedily on
the demo's 64 held-out problems, as `agent-r1 demo` evaluates the built-in run. Compare with that run's
`results.json` (its `rl` row) and its RL time.

    python benchmarks/gateway_demo.py --demo runs/demo [--out runs/gateway-demo] [--steps 12] [--function]

`--function` runs the program in-process (`task.function`, a thread per episode) instead of a command
line (`task.command`, a Python process per episode).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=Path("runs/demo"), help="a finished `agent-r1 demo` run")
    parser.add_argument("--out", type=Path, default=Path("runs/gateway-demo"))
    parser.add_argument("--steps", type=int, default=0, help="RL steps (0: the demo's)")
    parser.add_argument("--function", action="store_true", help="run the program as a function, not a command")
    args = parser.parse_args()
    from agent_r1.tasks import calculator

    demo = yaml.safe_load((args.demo / "rl" / "config.yaml").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    ops = tuple(demo["task"]["ops"])
    data = args.out / "train_tasks.jsonl"  # what the built-in task's tasks("train", 4096, seed) gives
    rows = calculator.make_tasks(4096, seed=demo["seed"], ops=ops, split="train")
    data.write_text("".join(json.dumps(t) + "\n" for t in rows))

    program = (
        {"function": "examples.calculator_agent:run"}
        if args.function
        else {"command": [sys.executable, str(ROOT / "examples" / "calculator_agent.py")]}
    )
    cfg = demo | {
        "task": {"name": "gateway", **program, "reward": "examples.calculator_agent:reward", "data": str(data)},
        "run_dir": str(args.out / "rl"),
        "val": demo["val"] | {"every": 0, "task": {}},  # the built-in run kept its last step too
    }
    if args.steps:
        cfg["steps"] = args.steps
    config = args.out / "rl.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    agent_r1 = [sys.executable, "-m", "agent_r1.cli"]
    t0 = time.perf_counter()
    subprocess.run([*agent_r1, "train", str(config)], cwd=ROOT, check=True)
    rl_s = time.perf_counter() - t0
    held_out = [
        f"model={args.out / 'rl' / 'policy'}", "task=calculator", "task.ops=[1,2,3]", "task.few_shot=false",
        "num_tasks=64", "temperature=0.0", "max_new_tokens=64", "max_turns=3", f"out={args.out / 'eval_rl.jsonl'}",
    ]  # fmt: skip  # the demo's eval section (recipes/demo.yaml)
    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, run_eval

    held, _ = run_eval(load_config(EvalConfig, None, held_out))
    builtin = json.loads((args.demo / "results.json").read_text())["results"]["rl"]
    metrics = [json.loads(line) for line in (args.out / "rl" / "metrics.jsonl").read_text().splitlines()]
    merged = sum(m.get("gateway/merged_steps", 0) for m in metrics)
    fresh = sum(m.get("gateway/fresh_steps", 0) for m in metrics)
    summary = {
        "rl_s": round(rl_s, 1),
        "rollout_s": round(sum(m["time/rollout"] for m in metrics), 1),
        "merged_share": merged / max(1e-9, merged + fresh),
        "held_out_accuracy": held["accuracy"],
        "builtin_rl_accuracy": builtin["accuracy"],
    }
    print(json.dumps(summary))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    # Run as a script, this directory heads sys.path, and its kernels.py would shadow the `kernels`
    # package that transformers probes for (a circular import at the first model class).
    here = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(ROOT))
    main()
