"""Decode attention on the CPU: PyTorch's SDPA against agent-r1's kernel (`engines/cpu/decode_attention.cpp`).

One layer of SmolLM2-135M's decode attention (3 kv heads of 3 query heads each, head_dim 64) for `--rows`
rows over the same number of columns each, read from a slot buffer as the engine holds it
([slots, kv heads, capacity, head_dim], fp32). SDPA gets its best case, rows of one length in one call
(the engine's SDPA path cuts rows of unlike lengths into several calls); the kernel reads each row's own
columns. Also printed: what reading the keys and values alone would take at this machine's memory
bandwidth (a 256 MB sum), the floor for any kernel. Each call reads another layer's buffer, of as many as
fill 512 MB, as a decode step's 30 layers do: one layer's keys and values, read again and again, stay in
a server CPU's L3 cache (tens of MB), and the kernel then seemed 2-3x faster than it runs in the engine.
`--kv-dtypes float32,bfloat16` also times the kernel over keys and values stored in bf16
(`LocalEngine(kv_cache_dtype=...)`, `agent-r1 serve`), each against SDPA over the same stored values
widened to fp32.

`--chunks 0:400,700:200` also times prompt chunks (tokens after held columns) through SDPA, as the engine
ran them on the CPU once, against the kernel as it runs them now (tiles of 16 tokens that read each key
once) and with a row a token, as it ran them before (the same call with the chunk's rows in reverse order,
which the kernel does not take for a chunk); each with this CPU's intrinsics and with the portable loops.

`--march x86-64-v3` builds the kernel for another CPU than this one (x86-64-v3: AVX2 and FMA, no AVX-512,
what most laptops have) and times that build: what such a machine's kernel does, at this one's speed.

`--layer 416` also times SmolLM2's first attention layer whole (projections, rotary embedding, slot
writes, attention) for `--rows` decoding rows at that many columns: transformers' forward over the slots
against `FusedSlotAttention`'s, alternated `--layer-repeats` times, with their outputs compared bit for bit.

    python benchmarks/attention.py [--rows 64] [--widths 64,256,630,1000] [--kv-dtypes float32]
                                   [--chunks held:tokens,...] [--layer columns] [--layer-repeats 6]
                                   [--march x86-64-v3]
"""

from __future__ import annotations

import argparse
import time
from itertools import cycle

import torch
import torch.nn.functional as F

from agent_r1.engines.cpu import decode_attention

LAYERS_BYTES = 512 * 2**20  # the layers' keys and values a width's calls cycle through: more than any L3 cache


def timed(fn, repeats: int = 20) -> float:
    """Seconds per call, after three warm-up calls."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--widths", default="64,256,630,1000")
    parser.add_argument("--kv-dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--chunks", default="", help="held:tokens,... prompt chunks after held columns, also timed")
    parser.add_argument("--layer", type=int, default=0, help="columns: also time a whole attention layer, fused or not")
    parser.add_argument("--layer-repeats", type=int, default=6)
    parser.add_argument("--march", default="native", help="the CPU to build the kernel for (gcc's -march)")
    args = parser.parse_args()
    if args.layer and args.march != "native":
        parser.error("--layer times the engine's own build of the kernel: leave out --march")
    torch.manual_seed(0)
    widths = [int(w) for w in args.widths.split(",")]
    dtypes = [getattr(torch, name) for name in args.kv_dtypes.split(",")]
    rows, kv_heads, group, dim, capacity = args.rows, 3, 3, 64, max(widths)
    kernel = decode_attention._build(args.march)  # what kernel_for returns, for another CPU if asked
    if kernel is None:
        raise SystemExit("the decode-attention kernel did not build on this machine (see the warning above)")
    big = torch.randn(64 * 2**20)  # 256 MB
    bandwidth = big.nbytes / timed(big.sum, 5) / 1e9
    print(f"{torch.get_num_threads()} torch threads; memory read {bandwidth:.0f} GB/s (a 256 MB sum)")
    layer_bytes = 2 * rows * kv_heads * capacity * dim * 4
    layers = [torch.randn(2, rows, kv_heads, capacity, dim) for _ in range(-(-LAYERS_BYTES // layer_bytes))]
    # each layer's keys, values [slots, Hkv, capacity, D]; a call reads the next layer's, from memory
    slots = torch.arange(rows)
    portable = torch.ops.agent_r1.decode_attention_portable  # its loops without this CPU's intrinsics
    simd = torch.ops.agent_r1.decode_attention_simd()
    print(f"the kernel's row intrinsics: {'built' if simd else 'not in this build'} (-march={args.march})")
    print(
        "| columns | keys, values | SDPA (fp32, one call) | kernel, portable loops | kernel | speed-up | "
        "at memory speed | max difference |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for width in widths:
        q = torch.randn(rows, kv_heads, group, dim)  # a kv head's query heads as queries of it
        out = torch.empty_like(q)
        starts, ends = torch.zeros(rows, dtype=torch.long), torch.full((rows,), width)
        fp32 = cycle([(kv[0, :, :, :width], kv[1, :, :, :width]) for kv in layers])
        sdpa = timed(lambda: F.scaled_dot_product_attention(q, *next(fp32)))  # noqa: B023
        for dtype in dtypes:
            stored = [tuple(kv.to(dtype)) for kv in layers]
            each = cycle(stored)
            loops = timed(lambda: portable(q, *next(each), slots, starts, ends, dim**-0.5, out))  # noqa: B023
            ours = timed(lambda: kernel(q, *next(each), slots, starts, ends, dim**-0.5, out))  # noqa: B023
            k, v = stored[-1]
            kernel(q, k, v, slots, starts, ends, dim**-0.5, out)  # the output compared below
            floor = 2 * rows * kv_heads * width * dim * k.element_size() / (bandwidth * 1e9)
            widened = k[:, :, :width].float(), v[:, :, :width].float()  # the stored values, as SDPA reads them
            diff = (out - F.scaled_dot_product_attention(q, *widened)).abs().max().item()
            print(
                f"| {width} | {str(dtype)[6:]} | {sdpa * 1e3:.2f} ms | {loops * 1e3:.2f} ms | {ours * 1e3:.2f} ms | "
                f"{sdpa / ours:.1f}x | "
                f"{floor * 1e3:.2f} ms | {diff:.1e} |"
            )
    if args.chunks:
        chunks(args.chunks, kernel, portable)
    if args.layer:
        layer(args.rows, args.layer, args.layer_repeats)


def chunks(pairs: str, kernel, portable) -> None:
    """A prompt chunk's attention, as the engine once ran it (SDPA over the chunk's slot: `is_causal` from
    column 0, a boolean mask after held columns), against the kernel in tiles of the chunk's tokens (what the
    engine does now on the CPU) and with each token a row that reads the slot up to its own column (before),
    with this CPU's intrinsics and with the portable loops."""
    kv_heads, group, dim = 3, 3, 64
    head = ["held", "tokens", "SDPA, masked"]
    for path in ("kernel", "portable"):
        head += [f"{path}, a row a token", f"{path}, tiles", "tiles / SDPA"]
    print("\n| " + " | ".join([*head, "max difference"]) + " |")
    print("|---" * (len(head) + 1) + "|")
    for pair in pairs.split(","):
        held, n = (int(x) for x in pair.split(":"))
        width = held + n
        k, v = torch.randn(2, 1, kv_heads, width, dim)  # one slot [1, Hkv, W, D] each
        q = torch.randn(1, kv_heads * group, n, dim)  # [1, Hq, n, D] as the engine's pass holds it
        cols = torch.arange(held, width)  # [n] the chunk's columns
        mask = (torch.arange(width)[None] <= cols[:, None])[None, None] if held else None  # [1, 1, n, W]

        def sdpa(q=q, k=k, v=v, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

        rows = q[0].transpose(0, 1).reshape(n, kv_heads, group, dim).contiguous()  # [n, Hkv, G, D]
        out, slots = torch.empty_like(rows), torch.zeros(n, dtype=torch.long)
        starts, ends = torch.zeros(n, dtype=torch.long), cols + 1
        back = [t.flip(0).contiguous() for t in (rows, slots, starts, ends)]  # no run of columns: a row a token
        expected, theirs = sdpa()[0].transpose(0, 1).reshape(n, kv_heads, group, dim), timed(sdpa)
        cells, diff = [str(held), str(n), f"{theirs * 1e3:.2f} ms"], 0.0
        for run in (kernel, portable):
            ours = timed(lambda: run(rows, k, v, slots, starts, ends, dim**-0.5, out))  # noqa: B023
            diff = max(diff, (out - expected).abs().max().item())
            by_row = timed(lambda: run(*back[:1], k, v, *back[1:], dim**-0.5, out))  # noqa: B023
            cells += [f"{by_row * 1e3:.2f} ms", f"{ours * 1e3:.2f} ms", f"{theirs / ours:.1f}x"]
        print("| " + " | ".join([*cells, f"{diff:.1e}"]) + " |")


def layer(rows: int, width: int, repeats: int) -> None:
    """SmolLM2's first attention layer at a decode step of `rows` rows, each at column width - 1 of its own
    slot: transformers' forward (over `slot_attention`) against `FusedSlotAttention`'s, alternated."""
    from agent_r1.engines.cpu import kv_cache
    from agent_r1.models.loading import load_model

    torch.set_grad_enabled(False)
    model, _ = load_model("default")
    kv_cache.use_slot_attention(model)
    cfg, attention = model.config, model.model.layers[0].self_attn
    cache = kv_cache.SlotCache(cfg.num_hidden_layers, cfg.num_key_value_heads, attention.head_dim, "cpu", torch.float32)
    cache.reserve(rows, width)
    for buf in cache.buf:
        buf.normal_()
    cache.written = width
    cols, slots = torch.full((rows,), width - 1), torch.arange(rows)
    segment = kv_cache.Segment(0, rows, 0, True, cols, width, width - 1, slots)
    hidden = torch.randn(1, rows, cfg.hidden_size)
    rope = model.model.rotary_emb(hidden, cols[None])
    fused = kv_cache.FusedSlotAttention.forward

    def own(self, *args, **kwargs):
        return super(kv_cache.FusedSlotAttention, self).forward(*args, **kwargs)

    def run(forward) -> tuple[float, torch.Tensor]:
        kv_cache.FusedSlotAttention.forward = forward
        with cache.packed(slots, cols, [segment]):
            call = lambda: attention(hidden, position_embeddings=rope, past_key_values=cache)[0]  # noqa: E731
            return timed(call, 100), call()

    print(f"\nan attention layer, {rows} rows at {width} columns: transformers' forward against the fused one")
    try:
        for _ in range(repeats):
            (a, out_a), (b, out_b) = run(own), run(fused)
            print(f"  {a * 1e3:.2f} ms against {b * 1e3:.2f} ms; the same output: {torch.equal(out_a, out_b)}")
    finally:
        kv_cache.FusedSlotAttention.forward = fused


if __name__ == "__main__":
    main()
