"""How agent-r1 should keep glibc's heap in check: its `mallopt` calls, glibc's own variables, or jemalloc.

    python benchmarks/malloc.py runs/demo/rl/config.yaml --steps 3

Runs the same RL (a finished demo's RL config, from its SFT policy, no validation) three times, one after
the other, in fresh processes: (1) as agent-r1 runs, with `utils/malloc.py`'s `mallopt` calls (a fixed
4 MB mmap threshold, raised while the engine decodes); (2) with glibc's own `MALLOC_MMAP_THRESHOLD_` and
`MALLOC_TRIM_THRESHOLD_` instead and no `mallopt` call, which cannot follow the engine; (3) under jemalloc
(`LD_PRELOAD`, Debian's libjemalloc2). Prints each run's wall clock, peak RSS, page faults, system time and
the seconds of rollout and update its steps logged; the steps' rewards must agree (the allocator changes
no number).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
ENV_ONLY = """
import sys
import agent_r1.utils.malloc as m
m._mallopt = lambda *a: False  # glibc's own variables only: no mallopt at start-up nor around the engine
from agent_r1.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(name: str, argv: list[str], env: dict[str, str], out: Path) -> dict[str, float]:
    """One training run under /usr/bin/time -v; its figures."""
    run_dir = out / name
    cmd = ["/usr/bin/time", "-v", *argv, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")

    def field(label: str) -> str:
        return re.search(rf"{label}: (.+)", proc.stderr).group(1).strip()

    wall = [float(x) for x in field(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\)").split(":")]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "wall_s": sum(x * 60**i for i, x in enumerate(reversed(wall))),
        "peak_gib": int(field(r"Maximum resident set size \(kbytes\)")) / 2**20,
        "page_faults_m": int(field(r"Minor \(reclaiming a frame\) page faults")) / 1e6,
        "system_s": float(field(r"System time \(seconds\)")),
        "rollout_s": sum(m["time/rollout"] for m in steps),
        "update_s": sum(m["time/update"] for m in steps),
        "rewards": [m["reward_mean"] for m in steps],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a finished demo's RL config (runs/demo/rl/config.yaml)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    train = ["train", args.config, f"steps={args.steps}", "val.every=0", f"save_every={args.steps}", "resume=false"]
    train.append("log.trajectories_every=0")
    agent_r1 = str(Path(sys.executable).with_name("agent-r1"))
    env_vars = {"MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}
    arms = {
        "mallopt": ([agent_r1, *train], {}),
        "glibc variables": ([sys.executable, "-c", ENV_ONLY, *train], env_vars),
        "jemalloc": ([agent_r1, *train], {"LD_PRELOAD": JEMALLOC}),
    }
    if not Path(JEMALLOC).is_file():
        print(f"no {JEMALLOC} (apt-get install libjemalloc2): jemalloc left out")
        del arms["jemalloc"]
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, argv, env, Path(tmp)) for name, (argv, env) in arms.items()}
    head = ("allocator", "wall s", "peak GiB", "faults M", "sys s", "rollout s", "update s")
    print(f"{head[0]:<16} " + " ".join(f"{h:>9}" for h in head[1:]))
    for name, r in results.items():
        print(
            f"{name:<16} {r['wall_s']:>9.0f} {r['peak_gib']:>9.3f} {r['page_faults_m']:>9.1f} {r['system_s']:>9.1f} "
            f"{r['rollout_s']:>9.1f} {r['update_s']:>9.1f}"
        )
    rewards = {tuple(r["rewards"]) for r in results.values()}
    print("the same rewards in every run" if len(rewards) == 1 else f"rewards differ: {rewards}")


if __name__ == "__main__":
    main()
