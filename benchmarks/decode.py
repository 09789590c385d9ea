"""Decode throughput of `LocalEngine` at batch >= 64 against the oneDNN matmul ceiling of this machine.

The ceiling is measured here, in the same process: GFLOP/s of oneDNN's linear op on the model's own
MLP shape (576 -> 1536 for SmolLM2-135M) at 1024 rows (its peak) and at the batch's row count. The
decode side runs `--rows` distinct prompts of `--prompt-tokens` tokens through the engine for
`--new-tokens` tokens each, EOS switched off so every row decodes to the end, and counts only the
decode forward passes (`engine.stats["decode_s"]`; prefill and sampling excluded).

FLOPs per decoded token = 2 x (parameters of every matmul, the tied LM head included) + the attention
over the context (4 x layers x hidden x context: scores and the weighted sum).

    python benchmarks/decode.py [--rows 64] [--prompt-tokens 300] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from agent_r1.models.loading import load_model
from agent_r1.models.onednn import _linear
from agent_r1.rollout.engine import SamplingParams
from agent_r1.rollout.local_engine import LocalEngine


def matmul_gflops(rows: int, d_in: int, d_out: int, repeats: int = 20) -> float:
    """oneDNN linear GFLOP/s with 8 distinct weight matrices (weights from memory, as in a forward)."""
    x = torch.randn(rows, d_in)
    weights = [torch.randn(d_out, d_in) for _ in range(8)]
    for w in weights:
        _linear(x, w)
    start = time.perf_counter()
    for i in range(repeats):
        _linear(x, weights[i % 8])
    return 2 * rows * d_in * d_out * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model)
    cfg = model.config
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    peak, at_rows = matmul_gflops(1024, hidden, inner), matmul_gflops(args.rows, hidden, inner)
    print(f"oneDNN {hidden}->{inner}: {peak:.0f} GFLOP/s at 1024 rows, {at_rows:.0f} at {args.rows} rows")

    rng = random.Random(0)
    prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.rows)]
    engine = LocalEngine(model, tokenizer, max_batch_size=args.rows, seed=0)
    engine.eos_ids = {-1}  # every row decodes all its tokens
    engine.generate_batch(prompts[:2], SamplingParams(max_new_tokens=4), [0, 1])  # warm-up
    before = dict(engine.stats)
    engine.generate_batch(prompts, SamplingParams(max_new_tokens=args.new_tokens), list(range(args.rows)))
    seconds = engine.stats["decode_s"] - before["decode_s"]
    tokens = engine.stats["decoded"] - before["decoded"]
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    context = args.prompt_tokens + args.new_tokens / 2  # the average context a decoded token attends to
    flops = tokens * (2 * matmul_params + 4 * cfg.num_hidden_layers * hidden * context)
    gflops = flops / seconds / 1e9
    print(f"decode: {args.rows} rows, {tokens} tokens in {seconds:.2f} s of decode: {tokens / seconds:.0f} tok/s")
    share = f"{gflops / peak:.0%} of the 1024-row rate, {gflops / at_rows:.0%} of the {args.rows}-row one"
    print(f"        {gflops:.0f} GFLOP/s: {share}")


if __name__ == "__main__":
    main()
