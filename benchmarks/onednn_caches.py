"""How much oneDNN's caches of prepared products grow a process, and what bounding them costs.

    python benchmarks/onednn_caches.py [--entries 1024 256 64]

Every product of a new shape (rows x weight) is an entry of oneDNN's primitive cache and of ideep's
computation cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, `LRU_CACHE_CAPACITY`; 1,024 entries each by
default). The rows change with every training micro-batch and decode step. For each capacity, a fresh
process runs SmolLM2-135M-shaped products as an RL step makes them: decode steps of 64 down to 1 rows
through 30 layers, then training micro-batches of 500-900 rows (forward and both backward products),
with glibc's heap trimmed as the trainer does. It prints the RSS growth and the seconds of each part.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

DECODE_STEPS, MICRO_BATCHES, LAYERS = 400, 40, 30


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def run_once() -> None:
    """The workload, in this process (its caches sized by the environment it was started with)."""
    import torch

    from agent_r1.models.onednn import _linear
    from agent_r1.utils.malloc import fix_mmap_threshold, trim_heap

    fix_mmap_threshold()
    torch.manual_seed(0)
    weights = [torch.randn(out, inp) for out, inp in [(576, 576), (192, 576), (1536, 576), (576, 1536)]]
    start, t = rss_mb(), time.perf_counter()
    for step in range(DECODE_STEPS):
        rows = 64 - step % 64
        for _ in range(LAYERS):
            h = torch.randn(rows, 576)
            for w in weights[:3]:
                _linear(h, w)
            _linear(torch.randn(rows, 1536), weights[3])
    decode_s, t = time.perf_counter() - t, time.perf_counter()
    rng = random.Random(0)
    for _ in range(MICRO_BATCHES):
        h = torch.randn(rng.randint(500, 900), 576)
        for _ in range(LAYERS):
            for w in weights[:3]:
                y = _linear(h, w)
                _linear(y, w.t())  # grad of the input
                _linear(y.t(), h.t())  # grad of the weight
        trim_heap()
    train_s = time.perf_counter() - t
    print(f"{rss_mb() - start:.0f} {decode_s:.2f} {train_s:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[1024, 256, 64])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_once()
        return
    print(f"{'entries per cache':>18}{'RSS growth MB':>15}{'decode s':>10}{'train s':>9}")
    for n in args.entries:
        env = os.environ | {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(n), "LRU_CACHE_CAPACITY": str(n)}
        out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
        grown, decode_s, train_s = out.stdout.split()
        print(f"{n:>18}{grown:>15}{decode_s:>10}{train_s:>9}")


if __name__ == "__main__":
    main()
