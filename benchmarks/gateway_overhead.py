"""What the gateway costs: the calculator workload rolled out in-process (`ToolEnv`) and through the gateway.

The same policy, the same 64 episodes at once (8 tasks x 8 samples, as a demo RL step), the same seeds:
the built-in calculator task's `ToolEnv`, then `examples/calculator_agent.py` through the gateway, as a
command (a Python process per episode), as a function (a thread per episode), and as a function whose
OpenAI clients share one `httpx.Client` (`function-shared`: without the ~20 ms of CPU, GIL held, that each new
client spends loading the CA bundle, which leaves the gateway's own cost). The example's requests
render to the built-in task's prompts token for token, so each mode samples the same ids; the script
counts the episodes whose steps match the in-process run's, which is what makes the times comparable.
Modes alternate over `--repeats` rounds; the overhead is the gateway's extra wall clock as a share of its own.

    python benchmarks/gateway_overhead.py [--model runs/demo/rl/policy] [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODES = ("toolenv", "command", "function", "function-shared")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/demo/rl/policy", help="a policy directory (a demo run's RL policy)")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/gateway_overhead.json"))
    args = parser.parse_args()

    from agent_r1.engines.cpu.local_engine import LocalEngine
    from agent_r1.engines.protocol import SamplingParams
    from agent_r1.env.prompt_format import prompt_format_for
    from agent_r1.gateway import ProgramEnvFactory
    from agent_r1.models.loading import load_model
    from agent_r1.rollout.agent_loop import AgentEnvLoop, correct, summarize
    from agent_r1.tasks import calculator
    from examples import calculator_agent

    model, tokenizer = load_model(args.model)
    options = calculator.Options(ops=(1, 2, 2), few_shot=False)  # the demo's RL task (recipes/demo.yaml)
    tasks = calculator.make_tasks(args.tasks, seed=0, ops=options.ops, split="train")
    fmt = prompt_format_for(tokenizer)
    envs = {
        "toolenv": lambda: calculator.make_env(options, fmt, max_turns=3),
        "command": ProgramEnvFactory(
            tokenizer, command=(sys.executable, str(ROOT / "examples" / "calculator_agent.py")),
            reward="examples.calculator_agent:reward", max_turns=3,
        ),
        "function": ProgramEnvFactory(
            tokenizer, function="examples.calculator_agent:run", reward="examples.calculator_agent:reward", max_turns=3
        ),
        "function-shared": ProgramEnvFactory(
            tokenizer, function=functools.partial(calculator_agent.run, http_client=httpx.Client(timeout=600)),
            reward="examples.calculator_agent:reward", max_turns=3,
        ),
    }  # fmt: skip
    sampling = SamplingParams(max_new_tokens=64, temperature=0.6)  # the demo's rollout settings
    times: dict[str, list[float]] = {m: [] for m in MODES}
    runs: dict[str, list] = {}
    for _ in range(args.repeats):
        for mode in MODES:
            engine = LocalEngine(model, tokenizer, seed=0, max_batch_size=64)
            loop = AgentEnvLoop(engine, envs[mode], sampling, seed=0)
            t0 = time.perf_counter()
            runs[mode] = loop.run_sync(tasks, args.group_size)
            times[mode].append(time.perf_counter() - t0)
            engine.wait_idle()
    same = {m: sum(_ids(a) == _ids(b) for a, b in zip(runs["toolenv"], runs[m], strict=True)) for m in MODES}
    base = statistics.median(times["toolenv"])
    result = {
        "model": args.model,
        "episodes": args.tasks * args.group_size,
        "seconds": {m: [round(t, 2) for t in ts] for m, ts in times.items()},
        "median_s": {m: round(statistics.median(ts), 2) for m, ts in times.items()},
        "overhead_share": {m: round(1 - base / statistics.median(times[m]), 3) for m in MODES[1:]},
        "episodes_identical_to_toolenv": same,
        "accuracy": {m: sum(map(correct, runs[m])) / len(runs[m]) for m in MODES},
        "turns": {m: summarize(runs[m])["turns"] for m in MODES},
        "errors": {m: summarize(runs[m])["termination/error"] for m in MODES},
        "merged_share": {m: _merged(runs[m]) for m in MODES[1:]},
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


def _ids(traj) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(s.prompt_ids), tuple(s.response_ids)) for s in traj.steps]


def _merged(trajs) -> float:
    merged = sum(t.metrics.get("gateway/merged_steps", 0.0) for t in trajs)
    return merged / max(1e-9, merged + sum(t.metrics.get("gateway/fresh_steps", 0.0) for t in trajs))


if __name__ == "__main__":
    # Run as a script, this directory heads sys.path, and its kernels.py would shadow the `kernels`
    # package that transformers probes for (a circular import at the first model class).
    here = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(ROOT))
    main()
