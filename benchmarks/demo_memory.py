"""Where a command's memory goes, phase by phase: RSS of the whole process tree sampled every 0.25 s,
split at the phase lines the command prints (the demo's `1/4 untrained model` ... `4/4 trained model`
rules).

    python benchmarks/demo_memory.py -- agent-r1 demo recipes/demo.yaml run_dir=runs/mem

Prints one line per phase (RSS when it began, its peak, RSS when it ended) and the whole run's peak,
which is what `/usr/bin/time -v` reports as "Maximum resident set size" for a single process.
Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

PHASE = re.compile(r"(\d/4 [a-zA-Z ]+?)\s*─")


def tree_rss(pid: int) -> int:
    """Bytes resident in `pid` and all its descendants (children are found through /proc/*/stat)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        tree.update(kids)
        frontier += kids
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/demo_memory.json"))
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()

    t0 = time.perf_counter()
    proc = subprocess.Popen(
        args.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ | {"COLUMNS": "100"}
    )
    samples: list[tuple[float, int]] = []
    marks: list[tuple[float, str]] = [(0.0, "start")]

    def sample() -> None:
        while proc.poll() is None:
            samples.append((time.perf_counter() - t0, tree_rss(proc.pid)))
            time.sleep(args.interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if m := PHASE.search(line):
            marks.append((time.perf_counter() - t0, m.group(1).strip()))
    proc.wait()
    sampler.join()
    end = time.perf_counter() - t0
    phases = []
    for (start, name), (stop, _) in zip(marks, [*marks[1:], (end, "")], strict=True):
        inside = [rss for t, rss in samples if start <= t < stop] or [0]
        phases.append({"phase": name, "start_s": round(start, 1), "seconds": round(stop - start, 1),
                       "rss_begin_gb": inside[0] / 1e9, "rss_peak_gb": max(inside) / 1e9,
                       "rss_end_gb": inside[-1] / 1e9})  # fmt: skip
    print(f"\n{'phase':<24}{'from s':>8}{'secs':>8}{'begin GB':>10}{'peak GB':>10}{'end GB':>9}")
    for p in phases:
        print(f"{p['phase']:<24}{p['start_s']:>8}{p['seconds']:>8}{p['rss_begin_gb']:>10.2f}"
              f"{p['rss_peak_gb']:>10.2f}{p['rss_end_gb']:>9.2f}")  # fmt: skip
    peak = max((rss for _, rss in samples), default=0)
    print(f"whole run: {end:.0f} s, peak RSS {peak / 1e9:.2f} GB, exit code {proc.returncode}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": args.command, "seconds": end, "peak_rss_gb": peak / 1e9,
                                    "phases": phases, "samples": samples}))  # fmt: skip
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
