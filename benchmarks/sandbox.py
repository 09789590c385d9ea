"""What the python tool's sandbox costs per call: a fresh interpreter per call vs a persistent one,
with bubblewrap isolation and without, one call at a time and a rollout-sized batch at once.

    .venv/bin/python benchmarks/sandbox.py [--calls 20] [--concurrent 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agent_r1.tools.sandbox import PythonSandbox, bwrap_problem

CODE = "x = sum(range(1000))\nx"


async def sequential(isolation: str, persistent: bool, calls: int) -> list[float]:
    """Seconds per call, one sandbox, calls one after another (the first includes the start)."""
    box = PythonSandbox(isolation=isolation, persistent=persistent)
    times = []
    try:
        for _ in range(calls):
            start = time.perf_counter()
            assert (await box.run(CODE)).output == "499500\n"
            times.append(time.perf_counter() - start)
    finally:
        await box.aclose()
    return times


async def concurrent(isolation: str, n: int) -> float:
    """Seconds for `n` trajectories' first calls at once (what one turn of a rollout batch does)."""
    boxes = [PythonSandbox(isolation=isolation) for _ in range(n)]
    start = time.perf_counter()
    results = await asyncio.gather(*(b.run(CODE) for b in boxes))
    seconds = time.perf_counter() - start
    await asyncio.gather(*(b.aclose() for b in boxes))
    assert all(r.output == "499500\n" for r in results)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--concurrent", type=int, default=64)
    args = parser.parse_args()
    isolations = ["none"] + (["bwrap"] if bwrap_problem() is None else [])
    print(f"{'isolation':<10} {'mode':<11} {'median ms/call':>15} {f'{args.concurrent} at once, s':>18}")
    for isolation in isolations:
        for persistent in (False, True):
            times = asyncio.run(sequential(isolation, persistent, args.calls))
            mode = "persistent" if persistent else "fresh"
            batch = f"{asyncio.run(concurrent(isolation, args.concurrent)):.2f}" if not persistent else ""
            print(f"{isolation:<10} {mode:<11} {1000 * statistics.median(times[1:]):>15.1f} {batch:>18}")


if __name__ == "__main__":
    main()
