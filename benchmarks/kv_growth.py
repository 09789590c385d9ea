"""Peak memory of `LocalEngine` while its KV cache grows to its budget, as a long multi-turn eval makes it.

Waves of requests with longer and longer prompts (random ids, EOS off) make the cache grow in columns and
slots until it reaches `--kv-cache-gb`. The peak RSS of the process (`ru_maxrss`) is compared with what
it holds at the end: the model, the cache and the rest. Run each variant in a fresh process. To measure
the code at another revision, put a checkout of it first on the path:

    python benchmarks/kv_growth.py [--kv-cache-gb 2] [--rows 32] [--lengths 256 1024 2048 3072]
    git worktree add /tmp/before REV && PYTHONPATH=/tmp/before python benchmarks/kv_growth.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource

import torch

import agent_r1
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.models.loading import load_model
from agent_r1.utils.malloc import _rss


def cache_bytes(engine: LocalEngine) -> int:
    buf = engine._cache.buf
    return 0 if buf is None else buf.nbytes if isinstance(buf, torch.Tensor) else sum(b.nbytes for b in buf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 3072])
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()

    model, tokenizer = load_model("default")
    engine = LocalEngine(model, tokenizer, seed=0, max_context=max(args.lengths) + args.new_tokens,
                         kv_cache_gb=args.kv_cache_gb)  # fmt: skip
    engine.eos_ids = {-1}  # every row decodes to the end
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    start = _rss()
    for n in args.lengths:
        prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for _ in range(args.rows)]
        asyncio.run(engine.generate(prompts, params))
        print(f"after {args.rows} prompts of {n:,} tokens: cache {cache_bytes(engine) / 2**30:.2f} GiB, "
              f"RSS {_rss() / 2**30:.2f} GiB")  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"agent_r1 from {agent_r1.__file__}")
    print("| kv_cache_gb | cache at the end | RSS before the first request | RSS at the end | peak RSS |")
    print(f"| {args.kv_cache_gb:g} | {cache_bytes(engine) / 2**30:.2f} GiB | {start / 2**30:.2f} GiB | "
          f"{_rss() / 2**30:.2f} GiB | **{peak / 2**30:.2f} GiB** |")  # fmt: skip


if __name__ == "__main__":
    main()
