"""The CPU decode-attention kernel: each row's attention over its own slot's columns, as SDPA computes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

from agent_r1.rollout import decode_attention, kv_cache
from agent_r1.rollout.decode_attention import kernel_for
from agent_r1.rollout.engine import SamplingParams
from agent_r1.rollout.local_engine import LocalEngine
from tests.conftest import recompute_logprobs, record_kernel_segments


def row_by_row(q, k, v, slots, starts, ends, scale):
    """The reference: one SDPA call per row over exactly its columns [start, end) of its slot."""
    out = torch.empty_like(q)  # [n, Hkv, G, D]
    for i, (s, a, b) in enumerate(zip(slots.tolist(), starts.tolist(), ends.tolist(), strict=True)):
        out[i] = F.scaled_dot_product_attention(q[i], k[s, :, a:b], v[s, :, a:b], scale=scale)  # [Hkv, G, D]
    return out


def kernels() -> dict[str, object]:
    """The kernel as the engine calls it (AVX-512 intrinsics where the CPU has them) and its portable
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


def test_a_kernel_that_cannot_build_warns_and_the_engine_decodes_on_sdpa(tiny_model, tokenizer, monkeypatch, tmp_path):
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
        with pytest.warns(UserWarning, match="did not build .*c\\+\\+: command not found.*decode runs on SDPA"):
            assert kernel_for(torch.float32, torch.device("cpu")) is None
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
