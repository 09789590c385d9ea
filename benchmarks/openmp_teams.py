"""Decode speed of `LocalEngine` when the thread that waits on it has an idle OpenMP team, kept or handed back.

libgomp throttles every team's spin-wait once the process's teams hold more workers than it has CPUs
(agent_r1/utils/openmp.py). The trainer's thread has a team after any parallel op (an update, an eval, a
model load); the engine's decode thread makes another. Each run decodes the same `--rows` prompts of
`--prompt-tokens` random ids for `--new-tokens` tokens (EOS off) through one engine and reports the seconds
of decode passes (`engine.stats["decode_s"]`). The arms, interleaved so that the machine's drift hits
each alike:

- `no team`: the main thread has run no parallel op (first, twice);
- `kept`: a parallel op on the main thread first, and the engine's hand-back patched to a no-op (the
  engine before `release_openmp_workers`);
- `handed back`: a parallel op on the main thread first, the engine as it is.

    python benchmarks/openmp_teams.py [--rows 64] [--prompt-tokens 100] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from agent_r1.engines.cpu import local_engine
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.models.loading import load_model
from agent_r1.utils.openmp import release_openmp_workers


def main_thread_parallel_op() -> None:
    """An op large enough that PyTorch runs it in parallel: the main thread gets an OpenMP team."""
    (torch.ones(4096, 1024) * 2).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model("default")
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.rows)]
    engine = LocalEngine(model, tokenizer, max_batch_size=args.rows, seed=0, max_prefill_tokens=len(prompts) * 1024)
    engine.eos_ids = {-1}  # every row decodes all its tokens

    def decode_seconds(release) -> float:
        local_engine.release_openmp_workers = release
        before = engine.stats["decode_s"]
        engine.generate_batch(prompts, SamplingParams(max_new_tokens=args.new_tokens), list(range(args.rows)))
        return engine.stats["decode_s"] - before

    times: dict[str, list[float]] = {"no team": [], "kept": [], "handed back": []}
    for _ in range(2):
        times["no team"].append(decode_seconds(release_openmp_workers))
    for _ in range(args.repeats):
        for arm, release in (("kept", lambda: False), ("handed back", release_openmp_workers)):
            main_thread_parallel_op()
            times[arm].append(decode_seconds(release))
    print(f"{args.rows} rows x {args.new_tokens} new tokens after {args.prompt_tokens}-token prompts, decode seconds:")
    for arm, ts in times.items():
        print(f"  {arm:12s} " + " / ".join(f"{t:.2f}" for t in ts) + f"   median {statistics.median(ts):.2f}")
    engine.sleep()


if __name__ == "__main__":
    main()
