"""Training forward+backward throughput on calculator demonstrations with the bundled model.

Compares, on the same 16 SFT rows (system prompt + question + a 2-turn tool-use episode):
  * packed rows with different micro-batch token budgets (block-diagonal attention over the pack),
  * the same with shared-prefix micro-batches (the common prompt prefix runs once, exact gradients).
"Row tokens/s" counts every token of every row, i.e. the work a naive trainer would do; the physical
ceiling for 135M parameters on this machine is ~290 tokens/s through torch's default matmul
(docs/log/measurements.md).

    python benchmarks/training.py [--rows 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.models import load_model
from agent_r1.tasks import calculator as recipe
from agent_r1.trainer.batching import Row, pack, token_logprobs
from agent_r1.trainer.sft import demo_to_sequence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    model, tok = load_model("default")
    fmt = ChatFormat(tok)
    env = recipe.make_env(recipe.Options(few_shot=False), fmt)
    prefix = env.prompt_prefix
    rows = []
    for demo in recipe.demos(recipe.Options(ops=(1, 2)), env, args.rows):
        seq = demo_to_sequence(demo, prefix, fmt, tok)
        n = len(seq.input_ids)
        ids, mask = torch.tensor(seq.input_ids), torch.tensor(seq.loss_mask, dtype=torch.float32)
        rows.append(Row(ids, mask, torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.long)))
    row_tokens = sum(len(r.input_ids) for r in rows)
    per_row = row_tokens / len(rows)
    print(f"{len(rows)} rows, {row_tokens} tokens ({per_row:.0f}/row), torch threads {torch.get_num_threads()}")
    model.train()
    print(f"{'mode':28} {'seconds':>8} {'computed tok':>13} {'row tok/s':>10}")
    for shared in (False, True):
        for budget in (4096, 1024, 512):
            mbs = pack(rows, budget, min_shared_prefix=32 if shared else 10**9)
            start = time.perf_counter()
            for mb in mbs:
                logp, _, _ = token_logprobs(model, mb)
                (-(logp * mb.mask).sum() / mb.mask.sum()).backward()
            seconds = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            name = f"{'shared prefix' if shared else 'packed'}, budget {budget}"
            computed = sum(mb.num_tokens for mb in mbs)
            print(f"{name:28} {seconds:8.1f} {computed:13d} {row_tokens / seconds:10.0f}")


if __name__ == "__main__":
    main()
