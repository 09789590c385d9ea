"""Decode throughput of `LocalEngine` at batch >= 64 against the oneDNN matmul ceiling of this machine.

The ceiling is measured here, in the same process: GFLOP/s of oneDNN's linear op on the model's own
MLP shape (576 -> 1536 for SmolLM2-135M) at 1024 rows (its peak) and at the batch's row count. The
decode side runs `--rows` distinct prompts of `--prompt-tokens` tokens through the engine for
`--new-tokens` tokens each, EOS switched off so every row decodes to the end, and counts only the
decode forward passes (`engine.stats["decode_s"]`; prefill and sampling excluded: the prompts are
prefilled in one pass before any row decodes). The engine keeps its weights in oneDNN's layout, as
`agent-r1 serve` runs it (`pack_weights=True`; the trainer's rollouts do not). `--baseline REV` runs
`LocalEngine` as it was at git revision REV first, in the same process, on the same prompts, with the
same prefill budget and packed weights where its constructor takes them.

FLOPs per decoded token = 2 x (parameters of every matmul, the tied LM head included) + the attention
over the context (4 x layers x hidden x context: scores and the weighted sum).

    python benchmarks/decode.py [--rows 64] [--prompt-tokens 300] [--new-tokens 64] [--spread 0] [--baseline REV]
                                [--kv-cache-dtypes float32,bfloat16] [--repeats 1] [--temperature 1]

`--kv-cache-dtypes float32,bfloat16` runs the current engine once with each KV storage
(`LocalEngine(kv_cache_dtype=...)`; serve's `kv_cache_dtype=bf16`), `--repeats N` every engine N times,
interleaved. `--portable-kernel` also runs each on the decode kernel's portable loops, what a CPU without
AVX-512 or AVX2 runs (`engines/cpu/decode_attention.cpp`).

`--spread S` draws each prompt's length uniformly from prompt-tokens +- S (rows of unlike lengths, as a
rollout's turns are).
"""

from __future__ import annotations

import argparse
import inspect
import random
import time

import torch
from engines import previous_engine_class

from agent_r1.engines.cpu import kv_cache
from agent_r1.engines.cpu.decode_attention import kernel_for
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.models.loading import load_model
from agent_r1.models.onednn import _linear


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


def portable_kernel_for(dtype: torch.dtype | None, device: torch.device):
    """`kernel_for`, answering the kernel's portable loops where it answers the kernel."""
    return torch.ops.agent_r1.decode_attention_portable if kernel_for(dtype, device) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--spread", type=int, default=0)
    parser.add_argument("--baseline", default=None, help="git revision of a previous LocalEngine to run first")
    parser.add_argument(
        "--kv-cache-dtypes",
        default="float32",
        help="the current engine's keys and values: float32, bfloat16",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each engine, interleaved")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy, to compare the engines' tokens")
    parser.add_argument(
        "--portable-kernel",
        action="store_true",
        help="also run each engine on the decode kernel's portable loops (a CPU without AVX-512 or AVX2)",
    )
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_model(args.model)
    cfg = model.config
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    peak, at_rows = matmul_gflops(1024, hidden, inner), matmul_gflops(args.rows, hidden, inner)
    print(f"oneDNN {hidden}->{inner}: {peak:.0f} GFLOP/s at 1024 rows, {at_rows:.0f} at {args.rows} rows")

    rng = random.Random(0)
    lengths = [args.prompt_tokens + rng.randint(-args.spread, args.spread) for _ in range(args.rows)]
    prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(n)] for n in lengths]
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    context = sum(lengths) / len(lengths) + args.new_tokens / 2  # the average context a decoded token attends to
    engines = []
    if args.baseline:  # run as the current one is, with what the previous engine's constructor takes of it
        cls = previous_engine_class(args.baseline)
        takes = inspect.signature(cls).parameters
        kw = {"max_prefill_tokens": sum(lengths), "pack_weights": True}
        engines.append(("previous", cls, {k: v for k, v in kw.items() if k in takes}, False))
    for portable in (False, True) if args.portable_kernel else (False,):
        for dtype in args.kv_cache_dtypes.split(","):
            # prefill, then decode only; the weights packed as `agent-r1 serve` keeps them
            kw = {"max_prefill_tokens": sum(lengths), "pack_weights": True, "kv_cache_dtype": getattr(torch, dtype)}
            name = "current" if dtype == "float32" else f"current, {dtype} keys and values"
            engines.append((name + (", portable kernel loops" if portable else ""), LocalEngine, kw, portable))
    sampled: dict[str, list[list[int]]] = {}  # each engine's tokens, from its first run
    for name, cls, kw, portable in engines * args.repeats:
        model.config._attn_implementation = "sdpa"  # each engine sets its own slot attention
        kv_cache.kernel_for = portable_kernel_for if portable else kernel_for
        engine = cls(model, tokenizer, max_batch_size=args.rows, seed=0, **kw)
        engine.eos_ids = {-1}  # every row decodes all its tokens
        engine.generate_batch(prompts[:2], SamplingParams(max_new_tokens=4), [0, 1][: args.rows])  # warm-up
        before = dict(engine.stats)
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature)
        outs = engine.generate_batch(prompts, params, list(range(args.rows)))
        seconds = engine.stats["decode_s"] - before["decode_s"]
        tokens = engine.stats["decoded"] - before["decoded"]
        flops = tokens * (2 * matmul_params + 4 * cfg.num_hidden_layers * hidden * context)
        gflops = flops / seconds / 1e9
        print(f"{name}: {args.rows} rows, {tokens} tokens in {seconds:.2f} s of decode: {tokens / seconds:.0f} tok/s")
        share = f"{gflops / peak:.0%} of the 1024-row rate, {gflops / at_rows:.0%} of the {args.rows}-row one"
        print(f"        {gflops:.0f} GFLOP/s: {share}; first row's tokens {outs[0].token_ids[:6]}")
        first = sampled.setdefault(name, [o.token_ids for o in outs])
        if name != "current" and "current" in sampled:  # the same seeds: rows whose tokens all match fp32's
            same = sum(a == b for a, b in zip(first, sampled["current"], strict=True))
            print(f"        rows whose {args.new_tokens} sampled tokens are the fp32 engine's: {same} of {args.rows}")
        prefill = engine.stats["prefill_s"] - before["prefill_s"]
        print(f"        prefill: {sum(lengths)} prompt tokens in {prefill:.2f} s: {sum(lengths) / prefill:.0f} tok/s")
        engine.sleep()


if __name__ == "__main__":
    main()
