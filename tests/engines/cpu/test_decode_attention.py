"""The CPU decode-attention kernel: each row's attention over its own slot's columns, as SDPA computes it."""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils import cpp_extension
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from agent_r1.engines.cpu import decode_attention, kv_cache
from agent_r1.engines.cpu.decode_attention import kernel_for
from agent_r1.engines.cpu.kv_cache import Segment, SlotCache, use_slot_attention
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from tests.conftest import make_tiny_llama, recompute_logprobs, record_kernel_segments


def row_by_row(q, k, v, slots, starts, ends, scale):
    """The reference: one SDPA call per row over exactly its columns [start, end) of its slot."""
    out = torch.empty_like(q)  # [n, Hkv, G, D]
    for i, (s, a, b) in enumerate(zip(slots.tolist(), starts.tolist(), ends.tolist(), strict=True)):
        out[i] = F.scaled_dot_product_attention(q[i], k[s, :, a:b], v[s, :, a:b], scale=scale)  # [Hkv, G, D]
    return out


def kernels() -> dict[str, object]:
    """The kernel as the engine calls it (AVX-512 or AVX2 intrinsics where the CPU has them) and its portable
    loops alone (what every other CPU runs): both are tested on any machine."""
    kernel = kernel_for(torch.float32, torch.device("cpu"))
    assert kernel is not None  # it builds wherever the tests run: a compiler comes with the machine
    return {"kernel": kernel, "portable": torch.ops.agent_r1.decode_attention_portable}


@pytest.mark.parametrize("path", ["kernel", "portable"])
@pytest.mark.parametrize("dim", [64, 128, 48])  # the intrinsics' head sizes, and one only the loops take
@pytest.mark.parametrize("group", [1, 3, 4, 6])  # query heads a kv head: the unrolled cases and the general one
def test_each_row_attends_to_exactly_its_columns_of_its_slot(group, dim, path):
    """Rows in any slots, in any order, of unlike lengths (whole blocks of 16 keys, a remainder, fewer
    than 16), some through a window (start > 0): the kernel's output is SDPA's on each row's own columns,
    to fp32 rounding."""
    torch.manual_seed(group)
    slots_n, heads, capacity = 7, 2, 80
    k, v = torch.randn(2, slots_n, heads, capacity, dim)  # [slots, Hkv, capacity, D] each
    slots = torch.tensor([5, 0, 3, 6, 1, 2])
    ends = torch.tensor([1, 77, 40, 13, 64, 48])  # a row at column 0 reads one column
    starts = torch.tensor([0, 60, 0, 9, 33, 16])  # 1, 17, 40, 4, 31 and 32 columns
    q = torch.randn(len(slots), heads, group, dim)
    out = torch.full_like(q, float("nan"))
    kernels()[path](q, k, v, slots, starts, ends, 0.125, out)
    assert (out - row_by_row(q, k, v, slots, starts, ends, 0.125)).abs().max().item() < 1e-5
    assert (out[0] == v[5, :, 0, None]).all()  # one column: its value, whatever the score


AVX2_BUILD = """
import torch
from agent_r1.engines.cpu import decode_attention
from tests.engines.cpu.test_decode_attention import row_by_row
kernel = decode_attention._build("x86-64-v3")  # one build a process: this one's kernel is the AVX2 build's
assert torch.ops.agent_r1.decode_attention_simd(), "the AVX2 build has no row intrinsics"
for dtype in (torch.float32, torch.bfloat16):
    for dim in (64, 128, 48):
        for group in (1, 2, 3, 4, 6):
            torch.manual_seed(group * dim)
            k, v = torch.randn(2, 5, 2, 300, dim).to(dtype)  # [slots, Hkv, capacity, D] each
            slots = torch.tensor([4, 0, 3, 1, 2])
            ends = torch.tensor([1, 77, 299, 13, 200])  # blocks of 8 keys, remainders, one column
            starts = torch.tensor([0, 60, 0, 9, 33])
            q = torch.randn(len(slots), 2, group, dim)
            out = torch.full_like(q, float("nan"))
            kernel(q, k, v, slots, starts, ends, 0.125, out)
            err = (out - row_by_row(q, k.float(), v.float(), slots, starts, ends, 0.125)).abs().max().item()
            assert err < 1e-5, f"{dtype} head_dim {dim}, {group} query heads: off by {err}"
print("checked")
"""


CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


@pytest.mark.skipif(not {"avx2", "fma"} <= set(CPU_FLAGS.split()), reason="an AVX2 build needs a CPU with AVX2")
def test_an_avx2_build_has_row_intrinsics_that_compute_sdpa():
    """Most laptops have AVX2 and not AVX-512: their build (x86-64-v3) sums 8 keys' scores at a time with
    intrinsics, as the AVX-512 build does 16. Built here in a process of its own, its rows must be SDPA's
    over each row's own columns for every head size and group, over fp32 and bf16 keys."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    args = [sys.executable, "-c", AVX2_BUILD]
    out = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "checked", out.stderr[-2000:]


def chunk_rows(slot: int, held: int, count: int, window: int | None = None):
    """A prompt chunk's rows as the engine passes them: `count` tokens of `slot` after `held` columns, token j
    reading its slot up to its own column (from its window's first, in a sliding-window layer)."""
    ends = torch.arange(held + 1, held + count + 1)
    starts = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)
    return torch.full((count,), slot), starts, ends


@pytest.mark.parametrize("path", ["kernel", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 48])  # 48: the portable tiles on any CPU
@pytest.mark.parametrize("group", [1, 3, 4, 6])  # the tiles' unrolled head counts, and one a head at a time
def test_prompt_chunks_beside_decoding_rows_attend_causally(group, dim, dtype, path):
    """Chunks of 17, 40, 2 and 16 tokens (whole tiles of 16, a remainder with padding lanes), one through a
    window, after held columns or from column 0, between decoding rows of other slots: each token's output
    is SDPA's over exactly its own columns, to fp32 rounding."""
    torch.manual_seed(group * dim)
    k, v = torch.randn(2, 6, 2, 120, dim).to(dtype)  # [slots, Hkv, capacity, D] each
    parts = [
        (torch.tensor([4]), torch.tensor([0]), torch.tensor([30])),  # a decoding row
        chunk_rows(0, 0, 17),
        chunk_rows(1, 50, 40, window=24),
        (torch.tensor([5]), torch.tensor([0]), torch.tensor([7])),
        chunk_rows(2, 3, 2),
        chunk_rows(3, 80, 16),
    ]
    slots, starts, ends = (torch.cat(x) for x in zip(*parts, strict=True))
    q = torch.randn(len(slots), 2, group, dim)
    out = torch.full_like(q, float("nan"))
    kernels()[path](q, k, v, slots, starts, ends, 0.125, out)
    expected = row_by_row(q, k.float(), v.float(), slots, starts, ends, 0.125)
    assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("path", ["kernel", "portable"])
def test_a_peaked_softmax_whose_small_weights_underflow_is_sdpas(path):
    """Scores hundreds apart (a model sure of one key): most weights are e^-100 and below, which fp32 cannot
    hold. The tiles' own exp (`exp_lane`, clamped at e^-87) and the rows' must give SDPA's output, finite."""
    torch.manual_seed(1)
    k, v = torch.randn(2, 2, 3, 100, 64)  # [slots, Hkv, capacity, D] each
    parts = [chunk_rows(0, 20, 40), (torch.tensor([1]), torch.tensor([0]), torch.tensor([90]))]
    slots, starts, ends = (torch.cat(x) for x in zip(*parts, strict=True))
    q = torch.randn(len(slots), 3, 3, 64) * 40  # score gaps of ~1,000 at scale 0.125
    out = torch.full_like(q, float("nan"))
    kernels()[path](q, k, v, slots, starts, ends, 0.125, out)
    expected = row_by_row(q, k, v, slots, starts, ends, 0.125)
    # scores ~100x those of the other tests: their fp32 rounding, summed in another order, is ~100x too
    assert torch.isfinite(out).all() and (out - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("path", ["kernel", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_tokens_output_does_not_depend_on_how_the_prompt_was_cut(dtype, path):
    """The prefill budget cuts a prompt into chunks wherever the pass's other rows leave room; a token's
    output is the same bit for bit however it was cut (its tile's other tokens add nothing to its sums).
    A token alone in its slot is a decoding row to the kernel: the same to fp32 rounding, summed in another
    order (which shows the tiles ran: a row a token would be cut-independent too)."""
    torch.manual_seed(0)
    k, v = torch.randn(2, 2, 3, 128, 64).to(dtype)
    q = torch.randn(60, 3, 3, 64)
    kernel = kernels()[path]

    def prefill(cuts: list[int]) -> torch.Tensor:
        """The 60 tokens of slot 0 after 10 held columns, a chunk a call, each after a decoding row of slot 1."""
        out = torch.empty_like(q)
        for a, b in zip([0, *cuts], [*cuts, 60], strict=True):
            parts = chunk_rows(1, 40, 1), chunk_rows(0, 10 + a, b - a)
            slots, starts, ends = (torch.cat(x) for x in zip(*parts, strict=True))
            rows = torch.cat([torch.randn(1, 3, 3, 64), q[a:b]])
            out_rows = torch.empty_like(rows)
            kernel(rows, k, v, slots, starts, ends, 0.125, out_rows)
            out[a:b] = out_rows[1:]
        return out

    whole = prefill([])
    assert torch.equal(prefill([7, 30]), whole)
    assert torch.equal(prefill([16, 32, 48]), whole)
    alone = prefill([1])  # token 0 alone
    assert torch.equal(alone[1:], whole[1:])
    assert (alone[0] - whole[0]).abs().max().item() < 1e-5
    assert not torch.equal(alone[0], whole[0])  # the tiles ran


@pytest.mark.parametrize(
    "slot, start, end, says",
    [(0, 3, 3, r"row 0 reads columns \[3, 3\) of slot 0"), (2, 0, 4, "of slot 2"), (1, 0, 9, r"\[0, 9\)")],
)
def test_bounds_outside_the_cache_or_empty_are_refused_not_read(slot, start, end, says):
    k = v = torch.zeros(2, 1, 8, 4)  # 2 slots of 8 columns
    q, out = torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    kernel = kernel_for(torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=says):
        kernel(q, k, v, torch.tensor([slot]), torch.tensor([start]), torch.tensor([end]), 1.0, out)


@pytest.mark.parametrize("path", ["kernel", "portable"])
def test_over_bf16_keys_and_values_it_is_sdpa_over_them_widened(path):
    """A bf16 KV cache (`kv_cache_dtype`): the kernel widens each stored key and value to fp32 as it reads
    them, so its output is SDPA's over the same bf16 values in fp32, to fp32 rounding."""
    torch.manual_seed(0)
    k, v = torch.randn(2, 4, 3, 50, 64).to(torch.bfloat16)  # [slots, Hkv, capacity, D] each
    slots, starts, ends = torch.tensor([2, 0, 3]), torch.tensor([0, 5, 0]), torch.tensor([50, 31, 1])
    q = torch.randn(3, 3, 3, 64)
    out = torch.empty_like(q)
    kernels()[path](q, k, v, slots, starts, ends, 0.125, out)
    assert (out - row_by_row(q, k.float(), v.float(), slots, starts, ends, 0.125)).abs().max().item() < 1e-5
    with pytest.raises(RuntimeError, match="keys and values float32 or bfloat16 alike"):
        kernel_for(torch.float32, torch.device("cpu"))(q, k, v.float(), slots, starts, ends, 0.125, out)


def test_it_covers_fp32_and_bf16_keys_on_the_cpu_and_nothing_else():
    assert kernel_for(torch.bfloat16, torch.device("cpu")) is not None
    assert kernel_for(torch.float16, torch.device("cpu")) is None
    assert kernel_for(torch.float32, torch.device("meta")) is None
    assert kernel_for(None, torch.device("cpu")) is None  # a cache that holds nothing yet


def test_a_kernel_that_cannot_build_warns_and_the_engine_decodes_on_sdpa(
    tiny_model, tokenizer, monkeypatch, tmp_path, caplog
):
    """No compiler (a laptop without one): one warning naming why, then SDPA per segment; the engine samples
    the same tokens with the trainer's log-probs."""
    prompts = [tokenizer.encode(t) for t in ("What is 12 * 34?", "Hi there", "Add 5 and 7")]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    with_kernel = LocalEngine(tiny_model, tokenizer, seed=0).generate_batch(prompts, params, [1, 2, 3])

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))  # nothing built
    decode_attention._build.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="agent_r1"):
            assert kernel_for(torch.float32, torch.device("cpu")) is None
        assert re.search("did not build .*c\\+\\+: command not found.*decode runs on SDPA", caplog.text)
        without = LocalEngine(tiny_model, tokenizer, seed=0).generate_batch(prompts, params, [1, 2, 3])
    finally:
        decode_attention._build.cache_clear()  # the next caller loads the built kernel again
    for p, a, b in zip(prompts, with_kernel, without, strict=True):
        assert a.token_ids == b.token_ids
        ref = recompute_logprobs(tiny_model, p + b.token_ids)[len(p) - 1 :]
        assert (ref - torch.tensor(b.logprobs)).abs().max().item() < 1e-4


def test_a_pass_that_chose_the_kernel_attends_row_by_row_when_it_is_gone(tiny_model, tokenizer, monkeypatch):
    """`_forward` chooses the kernel from the cache's dtype before the pass; were the keys then of another
    dtype (the cache follows the values'), `slot_attention` finds no kernel and attends each row through
    SDPA over the same columns, never calling None."""
    monkeypatch.setattr(kv_cache, "kernel_for", lambda dtype, device: None)
    prompts = [tokenizer.encode(t) for t in ("What is 12 * 34?", "Hi there", "Add 5 and 7")]
    chosen = record_kernel_segments(monkeypatch)
    outs = LocalEngine(tiny_model, tokenizer, seed=0).generate_batch(
        prompts, SamplingParams(max_new_tokens=12, temperature=1.0), [1, 2, 3]
    )
    assert any(chosen)
    for p, o in zip(prompts, outs, strict=True):
        ref = recompute_logprobs(tiny_model, p + o.token_ids)[len(p) - 1 :]
        assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 1e-4


def kernel_pass(model, cache, feeds) -> torch.Tensor:
    """One packed pass the kernel takes whole, as `LocalEngine._forward` lays it out: `feeds` is (slot, first
    column, token ids) in token order. Returns the logits [T, V]."""
    slots = [s for s, _, toks in feeds for _ in toks]
    cols = torch.tensor([c for _, col, toks in feeds for c in range(col, col + len(toks))])
    ids = [t for _, _, toks in feeds for t in toks]
    seg = Segment(0, len(ids), slots[0], True, cols, int(cols.max()) + 1, int(cols.min()), torch.tensor(slots))
    with cache.packed(torch.tensor(slots), cols, [seg]), torch.inference_mode():
        out = model(
            input_ids=torch.tensor([ids]), position_ids=cols[None],
            attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool), past_key_values=cache, use_cache=True,
        )  # fmt: skip
    return out.logits[0]


def tiny_qwen2(vocab_size: int) -> torch.nn.Module:
    """A 2-layer Qwen 2 (biased q, k, v projections) whose second layer reads a 4-column sliding window."""
    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(5)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_rope_store_is_transformers_rotation_and_slot_write_bit_for_bit(storage):
    """The fused op rotates the queries in place and writes each token's rotated key and its value at its
    slot and column: bitwise what transformers' `apply_rotary_pos_emb` and `SlotCache`'s update give,
    stored as fp32 or rounded to bf16."""
    torch.manual_seed(0)
    n, heads, kv_heads, dim, slots_n, capacity = 37, 9, 3, 64, 5, 50
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    angles = torch.rand(n, dim // 2) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [n, D]
    slots, cols = torch.randint(0, slots_n, (n,)), torch.randperm(capacity)[:n]
    want_q, want_k = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos[None], sin[None])
    want = torch.zeros(2, slots_n, kv_heads, capacity, dim, dtype=storage)
    want[0][slots, :, cols] = want_k[0].transpose(0, 1).to(storage)
    want[1][slots, :, cols] = v.to(storage)
    kernel_for(torch.float32, torch.device("cpu"))  # loads the library
    got = torch.zeros_like(want)
    torch.ops.agent_r1.rope_store(q, k, v, cos, sin, got, slots, cols)
    assert torch.equal(q, want_q[0].transpose(0, 1)) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="token 3 goes to column 50 of slot"):
        torch.ops.agent_r1.rope_store(q, k, v, cos, sin, got, slots, torch.where(torch.arange(n) == 3, 50, cols))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_attention_is_the_layers_own_forward_bit_for_bit(tokenizer, family, monkeypatch):
    """Kernel passes of prompts and of decoding rows beside a prompt chunk, through a Llama and through a
    Qwen 2 with q, k, v biases and a sliding-window layer: the fused attention's logits and the keys and
    values it stores are bitwise those of transformers' own forward over the same slots (`FusedSlotAttention`
    off), and the trainer's forward is the class's own."""
    vocab = len(tokenizer)
    model = make_tiny_llama(vocab, seed=6) if family == "llama" else tiny_qwen2(vocab)
    torch.manual_seed(1)
    p0, p1, p2 = (torch.randint(3, 100, (n,)).tolist() for n in (7, 12, 9))
    with torch.inference_mode():
        trainer = model(input_ids=torch.tensor([p1])).logits  # before: the class's own forward over SDPA
    use_slot_attention(model)
    attention = model.model.layers[0].self_attn
    assert isinstance(attention, kv_cache.FusedSlotAttention)
    assert type(copy.deepcopy(model).model.layers[0].self_attn) is type(attention).__bases__[1]  # copies: plain
    passes = [
        [(0, 0, p0), (1, 0, p1[:5])],
        [(0, 7, [11]), (1, 5, p1[5:]), (2, 0, p2)],
        [(0, 8, [12]), (1, 12, [13]), (2, 9, [14])],
    ]

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cache = SlotCache(2, model.config.num_key_value_heads, model.config.hidden_size // 4, "cpu", torch.float32)
        cache.reserve(slots=3, capacity=32)
        return [kernel_pass(model, cache, feeds) for feeds in passes], cache.buf

    fused_logits, fused_kv = run()
    own = kv_cache.FusedSlotAttention.forward
    monkeypatch.setattr(
        kv_cache.FusedSlotAttention,
        "forward",
        lambda self, *a, **kw: super(kv_cache.FusedSlotAttention, self).forward(*a, **kw),
    )
    own_logits, own_kv = run()
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, own_logits, strict=True))
    for slot, held in enumerate((9, 13, 10)):  # the columns each slot's keys and values were written to
        assert all(
            torch.equal(a[:, slot, :, :held], b[:, slot, :, :held]) for a, b in zip(fused_kv, own_kv, strict=True)
        )
    monkeypatch.setattr(kv_cache.FusedSlotAttention, "forward", own)
    with torch.inference_mode():  # outside a packed pass the mixed-in class is the class it was
        assert torch.equal(model(input_ids=torch.tensor([p1])).logits, trainer)


def test_attention_of_another_forward_is_left_as_it_is(tokenizer):
    """Qwen 3 normalises its queries and keys before the rotation: not the forward the fused one stands in
    for, so its attention keeps its class."""
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config)
    use_slot_attention(model)
    assert type(model.model.layers[0].self_attn) is transformers.models.qwen3.modeling_qwen3.Qwen3Attention
