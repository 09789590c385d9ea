import asyncio
import copy
import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from agent_r1.engines.cpu import kv_cache, local_engine
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.models.onednn import _PACKS, OneDNNLinear, onednn_available
from agent_r1.models.precision import autocast, set_precision
from agent_r1.utils import malloc, openmp
from tests.conftest import make_tiny_llama, recompute_logprobs, record_kernel_segments, recorded_passes


def gen(engine, prompts, **kw):
    return engine.generate_batch(prompts, SamplingParams(**kw), seeds=list(range(len(prompts))))


def prompts_of(tokenizer):
    texts = [
        "Hello there, how are you today?",
        "2+2",
        "The quick brown fox jumps over the lazy dog again and again",
    ]
    return [tokenizer.encode(t) for t in texts]


def test_greedy_matches_hf_generate(engine, tiny_model, tokenizer):
    prompt = prompts_of(tokenizer)[0]
    (out,) = gen(engine, [prompt], max_new_tokens=12, temperature=0.0)
    ref = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert out.token_ids == ref[0, len(prompt) :].tolist()
    assert out.finish_reason == "length"


def test_left_padded_batch_equals_single_rows(engine, tokenizer):
    prompts = prompts_of(tokenizer)
    batched = gen(engine, prompts, max_new_tokens=10, temperature=0.0)
    for p, b in zip(prompts, batched, strict=True):
        (single,) = gen(engine, [p], max_new_tokens=10, temperature=0.0)
        assert b.token_ids == single.token_ids
        assert max(abs(x - y) for x, y in zip(b.logprobs, single.logprobs, strict=True)) < 1e-4


@pytest.fixture(params=["kernel", "sdpa"])
def decode_path(request, monkeypatch):
    """Decode attention through the CPU kernel (fp32 on the CPU) and through SDPA per segment (a GPU, bf16,
    a machine where the kernel did not build)."""
    calls, kernel_for = [], kv_cache.kernel_for
    monkeypatch.setattr(kv_cache, "kernel_for", lambda dtype, device: calls.append(dtype) or kernel_for(dtype, device))
    if request.param == "sdpa":
        monkeypatch.setattr(local_engine, "kernel_for", lambda dtype, device: None)
    yield request.param
    assert bool(calls) == (request.param == "kernel")  # the path under test is the one that ran


def test_sampled_logprobs_match_a_plain_forward(engine, tiny_model, tokenizer, decode_path):
    prompts = prompts_of(tokenizer)
    for temperature in (1.0, 0.7):
        outs = gen(engine, prompts, max_new_tokens=16, temperature=temperature)
        for p, o in zip(prompts, outs, strict=True):
            ref = recompute_logprobs(tiny_model, p + o.token_ids, temperature)[len(p) - 1 :]
            assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 1e-4


def test_under_bf16_autocast_the_engine_samples_with_the_trainers_logprobs(tokenizer):
    """`dtype=bf16` (autocast over fp32 weights): the values come out of their projection in bf16 but
    RoPE's fp32 cos and sin make the keys fp32. The slot cache keeps both in bf16, as SDPA reads them
    (it once refused the mixed pair: every episode errored on the GPU), and the sampled tokens'
    log-probs are the trainer's forward under the same autocast."""
    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    set_precision(model, "bf16")
    engine = LocalEngine(model, tokenizer, seed=0)
    prompts = prompts_of(tokenizer)
    outs = gen(engine, prompts, max_new_tokens=16, temperature=1.0)
    assert engine._cache.dtype == torch.bfloat16
    with autocast(model):
        drift = torch.cat(
            [recompute_logprobs(model, p + o.token_ids)[len(p) - 1 :] - torch.tensor(o.logprobs)
             for p, o in zip(prompts, outs, strict=True)]
        ).abs()  # fmt: skip
    assert all(len(o.token_ids) == 16 for o in outs) and float(drift.mean()) < 0.02


def bf16_kv_attention(module, query, key, value, *args, **kwargs):
    """SDPA over keys and values rounded to bf16 and back: the reference for a cache that stores them so."""
    key, value = key.to(torch.bfloat16).float(), value.to(torch.bfloat16).float()
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


AttentionInterface.register("bf16_kv_reference", bf16_kv_attention)
AttentionMaskInterface.register("bf16_kv_reference", sdpa_mask)


def test_a_bf16_kv_cache_samples_with_the_logprobs_of_a_forward_over_rounded_keys(tiny_model, tokenizer, decode_path):
    """`kv_cache_dtype=torch.bfloat16` (`agent-r1 serve kv_cache_dtype=bf16`): keys and values are stored in
    bf16, half the bytes a token, and read back widened to fp32 by the kernel or for SDPA. The sampled
    log-probs are those of a plain fp32 forward whose attention reads the same keys and values rounded to
    bf16, to fp32 rounding; an fp32 forward over exact keys differs by more."""
    engine = LocalEngine(tiny_model, tokenizer, seed=0, kv_cache_dtype=torch.bfloat16)
    prompts = prompts_of(tokenizer)
    outs = gen(engine, prompts, max_new_tokens=16, temperature=1.0)
    cache = engine._cache
    assert cache.dtype == torch.bfloat16 and all(b.dtype == torch.bfloat16 for b in cache.buf)
    assert cache.bytes_per_token() == cache.bytes_per_token(torch.float32) // 2
    config = tiny_model.config

    def forward() -> torch.Tensor:
        pairs = zip(prompts, outs, strict=True)
        return torch.cat([recompute_logprobs(tiny_model, p + o.token_ids)[len(p) - 1 :] for p, o in pairs])

    exact = forward()
    kept, config._attn_implementation = config._attn_implementation, "bf16_kv_reference"
    try:
        rounded = forward()
    finally:
        config._attn_implementation = kept
    sampled = torch.tensor([lp for o in outs for lp in o.logprobs])
    assert all(len(o.token_ids) == 16 for o in outs)
    assert (rounded - sampled).abs().max().item() < 1e-4
    assert (exact - sampled).abs().max().item() > 1e-4  # the rounding is there to see


def test_a_bf16_model_decodes_through_batched_sdpa_not_the_fp32_query_kernel(tokenizer, monkeypatch):
    """A model loaded in bf16 (no autocast) computes bf16 queries, which the CPU kernel does not take: its
    decoding rows attend through SDPA in runs of slots, never one SDPA call per row."""
    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id).to(torch.bfloat16)
    kernel_segments = record_kernel_segments(monkeypatch)
    outs = gen(LocalEngine(model, tokenizer, seed=0), prompts_of(tokenizer), max_new_tokens=6, temperature=1.0)
    assert all(len(o.token_ids) == 6 for o in outs) and kernel_segments and not any(kernel_segments)


def test_a_kv_cache_dtype_the_engine_cannot_store_is_refused(tiny_model, tokenizer):
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype must be None, torch\.float32 or torch\.bfloat16, got torch\.int8"
    ):
        LocalEngine(tiny_model, tokenizer, kv_cache_dtype=torch.int8)


def test_sampled_logprobs_are_as_exact_as_the_trainers_over_a_real_vocabulary():
    """The engine's log-probs are z - logsumexp(z), the trainer's formula, to fp32 accuracy against a
    float64 computation. torch's fp32 log_softmax kernel on AVX-512 CPUs was off by 1e-5 here, which
    made an overfit model's engine-vs-trainer drift 1.2e-4 (over the 1e-4 check)."""
    torch.manual_seed(0)
    logits = torch.randn(8, 49152) * 3  # [b, V] SmolLM2's vocabulary
    logits[:, 7] = 16.0  # a confident token, as a trained policy's
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=0.7)] * 4
    tokens, logp = local_engine._sample(logits, params, [torch.Generator().manual_seed(i) for i in range(8)])
    temperature = torch.tensor([1.0] * 4 + [0.7] * 4, dtype=torch.float64)[:, None]
    exact = torch.log_softmax(logits.double() / temperature, dim=-1).gather(1, tokens[:, None])[:, 0]  # [b]
    assert tokens[:4].tolist() == [7] * 4  # greedy rows take the argmax
    assert (logp.double() - exact).abs().max().item() < 4e-6


def test_seeded_rows_do_not_depend_on_batch_company(engine, tokenizer):
    prompts = prompts_of(tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    alone = engine.generate_batch(prompts[:1], params, seeds=[42])
    together = engine.generate_batch(prompts, params, seeds=[42, 7, 8])
    again = engine.generate_batch(prompts[:1], params, seeds=[42])
    other = engine.generate_batch(prompts[:1], params, seeds=[43])
    assert alone[0].token_ids == together[0].token_ids == again[0].token_ids
    assert other[0].token_ids != alone[0].token_ids


@pytest.mark.parametrize(
    "temperature, top_p, expected",
    [  # softmax([2, 1, 0, -1] / T) by hand; top-p keeps the smallest prefix of the sorted tokens with mass >= p
        (1.0, 1.0, [0.6439, 0.2369, 0.0871, 0.0321]),
        (0.5, 1.0, [0.8650, 0.1171, 0.0158, 0.0021]),
        (1.0, 0.7, [0.7311, 0.2689, 0.0, 0.0]),
    ],
)
def test_sampled_tokens_follow_the_tempered_nucleus_distribution(temperature, top_p, expected):
    """4,000 rows, each its own generator, over four logits: the share of each token is its probability
    (within 4 standard errors), and each log-prob is log softmax(z / T) of the token drawn."""
    n, z = 4000, torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = [SamplingParams(temperature=temperature, top_p=top_p)] * n
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens, logp = local_engine._sample(z.repeat(n, 1), params, gens)
    share = torch.bincount(tokens, minlength=4).double() / n
    for got, want in zip(share.tolist(), expected, strict=True):
        assert abs(got - want) <= 4 * (want * (1 - want) / n) ** 0.5 + 1e-9, (share, expected)
    exact = [
        math.log(math.exp(v / temperature) / sum(math.exp(x / temperature) for x in z.tolist())) for v in z.tolist()
    ]
    assert (logp.double() - torch.tensor(exact, dtype=torch.float64)[tokens]).abs().max() < 1e-6


@pytest.mark.parametrize("vocab", [49152, 1300, 300])  # whole blocks; a tail block; fewer tokens than a block
def test_the_two_level_inverse_cdf_picks_what_one_running_sum_picks(vocab):
    """The sampler finds each draw's token block by block (`_inverse_cdf`): the token a running sum over the
    whole row picks (in float64 here), but at rounding boundaries, and never one of zero mass, even for a
    draw of 0 or just under 1."""
    torch.manual_seed(vocab)
    probs = (torch.randn(256, vocab) * 3).exp()  # [s, V] unnormalised
    probs[:, ::7] = 0
    probs[:, -40:] = 0  # the last tokens, and every seventh, without mass
    draws = torch.rand(256)
    draws[:3] = torch.tensor([0.0, 1 - 2**-24, 0.5])
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (draws.double() * cdf[:, -1])[:, None], right=True).squeeze(-1)
    got = local_engine._inverse_cdf(probs, draws)
    assert (got != want).sum() <= 2 and got[0] == want[0] and got[1] == want[1]
    assert (probs.gather(-1, got[:, None]) > 0).all()


def test_tiny_top_p_is_greedy(engine, tokenizer):
    prompt = prompts_of(tokenizer)[1]
    (greedy,) = gen(engine, [prompt], max_new_tokens=8, temperature=0.0)
    (nucleus,) = gen(engine, [prompt], max_new_tokens=8, temperature=1.0, top_p=1e-6)
    assert nucleus.token_ids == greedy.token_ids


def test_stop_string_and_eos_end_a_row_early(engine, tokenizer):
    prompt = prompts_of(tokenizer)[0]
    (full,) = gen(engine, [prompt], max_new_tokens=10, temperature=0.0)
    stop_text = tokenizer.decode(full.token_ids[:4])
    (stopped,) = gen(engine, [prompt], max_new_tokens=10, temperature=0.0, stop=(stop_text,))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert stop_text in stopped.text and len(stopped.token_ids) <= 4

    engine.eos_ids = {full.token_ids[2]}
    (eos,) = gen(engine, [prompt], max_new_tokens=10, temperature=0.0)
    assert eos.finish_reason == "eos"
    first = full.token_ids.index(full.token_ids[2])
    assert eos.token_ids == full.token_ids[: first + 1]  # the EOS id is kept (it was sampled)


def test_context_budget_caps_new_tokens(engine, tokenizer):
    prompt = prompts_of(tokenizer)[0]
    engine.max_context = len(prompt) + 3
    (out,) = gen(engine, [prompt], max_new_tokens=50, temperature=1.0)
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


@pytest.fixture
def forwards():
    with recorded_passes() as calls:
        yield calls


async def test_concurrent_calls_are_prefilled_together(engine, tokenizer, forwards):
    prompts = prompts_of(tokenizer)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    outs = await asyncio.gather(*(engine.generate([p], params) for p in prompts))
    assert forwards[0] == (0, tuple(map(len, prompts)))  # one pass prefills the three prompts
    assert forwards[1:] == [(3, ())] * 3  # then the 3 rows decode together
    assert all(len(o[0].token_ids) == 4 for o in outs)


async def test_on_token_streams_every_sampled_token_in_order(engine, tokenizer):
    prompts = prompts_of(tokenizer)[:2]
    seen: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    outs = await engine.generate(prompts, params, on_token=lambda i, tok, lp: seen[i].append((tok, lp)))
    for i, out in enumerate(outs):
        assert [t for t, _ in seen[i]] == out.token_ids and [lp for _, lp in seen[i]] == out.logprobs
    assert [o.token_ids for o in outs] == [o.token_ids for o in await engine.generate(prompts, params)]


@pytest.mark.parametrize("pack", [True, False])
def test_forward_passes_run_inside_the_engine_heap_and_packed_weights_and_leave_them_when_idle(
    tiny_model, tokenizer, pack
):
    """Every pass runs while the decode thread holds `engine_heap` (its tensors reuse heap pages) and,
    with `pack_weights`, `packed_weights` (its products read weights already in oneDNN's layout, the
    same to the bit); once the engine is idle nothing holds them, so the update's allocations are the
    CLI's again, and `sleep` frees the packed copies. Without it (the default) no pass packs."""
    engine = LocalEngine(tiny_model, tokenizer, seed=0, pack_weights=pack)
    held, packs = [], []

    def record(module, args) -> None:
        held.append(malloc._engines)
        packs.append(_PACKS.get())

    hook = tiny_model.register_forward_pre_hook(record)
    try:
        outs = gen(engine, prompts_of(tokenizer)[:2], max_new_tokens=5, temperature=1.0)
    finally:
        hook.remove()
    assert len(held) >= 5 and set(held) == {1}
    if not pack:
        assert set(packs) == {None}
        return
    assert all(p is packs[0] for p in packs)  # one set of packs for the thread's whole run
    linears = [m for m in tiny_model.modules() if isinstance(m, OneDNNLinear)] if onednn_available() else []
    assert set(packs[0]) == set(linears)  # every linear layer packed once (each pass had two rows)
    for p, o in zip(prompts_of(tokenizer)[:2], outs, strict=True):  # sampled from the packed weights
        ref = recompute_logprobs(tiny_model, p + o.token_ids, 1.0)[len(p) - 1 :]
        assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 1e-4
    assert engine.wait_idle() and malloc._engines == 0
    engine.sleep()
    assert packs[0] == {}  # freed with the KV memory


def test_the_waiting_caller_hands_back_its_openmp_workers(engine, tokenizer, monkeypatch):
    """A caller's idle OpenMP team would make every decode step's parallel regions wait on sleeping
    workers (utils/openmp.py); the thread that submits, and then waits, releases it."""
    released = []

    def release() -> bool:
        released.append((threading.get_ident(), openmp.release_openmp_workers()))
        return released[-1][1]

    monkeypatch.setattr(local_engine, "release_openmp_workers", release)
    gen(engine, prompts_of(tokenizer)[:2], max_new_tokens=3)
    assert released == [(threading.get_ident(), openmp._libgomp() is not None)]


async def test_cancelled_caller_frees_its_row_at_the_next_step(engine, tokenizer, forwards):
    first_token = asyncio.Event()
    params = SamplingParams(max_new_tokens=400, temperature=0.0)
    doomed = asyncio.create_task(engine.generate([prompts_of(tokenizer)[0]], params, lambda *_: first_token.set()))
    survivor = asyncio.create_task(engine.generate([prompts_of(tokenizer)[1]], dataclasses.replace(params, seed=1)))
    await first_token.wait()
    doomed.cancel()
    (out,) = await survivor
    assert len(out.token_ids) == 400  # the other row decoded to its budget
    decodes = [rows for rows, _ in forwards if rows]
    assert decodes[0] == 2 and decodes[-1] == 1 and decodes.count(2) < 20  # the cancelled row left early
    survivor_prompt = prompts_of(tokenizer)[1]
    kept = [e.tokens[: len(survivor_prompt)] for e in engine._parked]
    assert kept == [survivor_prompt]  # the survivor's keys are kept for a next turn; the aborted row's are freed
    with pytest.raises(asyncio.CancelledError):
        await doomed


async def test_engine_failure_reaches_every_caller(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        await engine.generate([[]], SamplingParams(max_new_tokens=2))


def test_sampling_params_reject_bad_values():
    for kw in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


SYSTEM = "You are a careful assistant. Use the calculator tool for every computation. " * 2


def generate_recording_shapes(engine, prompts, **kw):
    """Generate, returning the outputs and every forward pass (`recorded_passes`), in order."""
    with recorded_passes() as calls:
        return gen(engine, prompts, **kw), calls


def assert_logprobs_match_a_plain_forward(model, prompts, outs):
    for p, out in zip(prompts, outs, strict=True):
        ref = recompute_logprobs(model, p + out.token_ids)[len(p) - 1 :]
        assert (ref - torch.tensor(out.logprobs)).abs().max().item() < 1e-4


def test_shared_prefix_is_prefilled_once_and_changes_nothing(engine, tiny_model, tokenizer):
    system = tokenizer.encode(SYSTEM)
    prompts = [system + tokenizer.encode(q) for q in ("What is 12 * 34?", "Hi", "Add 5 and 7, then double it")]
    batched, calls = generate_recording_shapes(engine, prompts, max_new_tokens=8, temperature=1.0)
    assert calls[0] == (0, (len(system),)) and len(calls[1][1]) == 3  # the prefix ran once, then the suffixes
    assert sum(calls[1][1]) == sum(len(p) - len(system) for p in prompts)
    assert_logprobs_match_a_plain_forward(tiny_model, prompts, batched)
    greedy = gen(engine, prompts, max_new_tokens=8, temperature=0.0)
    for p, out in zip(prompts, greedy, strict=True):
        assert out.token_ids == gen(engine, [p], max_new_tokens=8, temperature=0.0)[0].token_ids


def test_a_groups_repeated_prompt_is_prefilled_once(engine, tiny_model, tokenizer):
    system = tokenizer.encode(SYSTEM)
    a, b = (system + tokenizer.encode(q) for q in ("What is 12 * 34?", "Add 5 and 7, then double it"))
    prompts = [a, a, a, b, b]  # two GRPO groups
    outs, calls = generate_recording_shapes(engine, prompts, max_new_tokens=12, temperature=1.0)
    assert calls[0] == (0, (len(system),)) and len(calls[1][1]) == 2  # the shared prefix, the 2 distinct prompts
    assert calls[2] == (5, ())  # then all 5 rows decode
    assert_logprobs_match_a_plain_forward(tiny_model, prompts, outs)
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # the copies sample independently


# --- continuous batching and keys kept across turns ---------------------------------------------


def greedy_alone(tiny_model, tokenizer, prompt: list[int], n: int):
    """What a fresh engine that has seen nothing else answers (nothing kept, nothing shared)."""
    fresh = LocalEngine(tiny_model, tokenizer, seed=0, max_context=1024)
    return gen(fresh, [prompt], max_new_tokens=n, temperature=0.0)[0]


async def test_a_request_joins_the_running_batch_mid_decode(engine, tiny_model, tokenizer, forwards):
    long_prompt, short_prompt = prompts_of(tokenizer)[0], prompts_of(tokenizer)[2]
    started = asyncio.Event()
    count = [0]

    def on_token(*_):
        count[0] += 1
        if count[0] == 5:
            started.set()

    greedy = SamplingParams(max_new_tokens=120, temperature=0.0)
    first = asyncio.create_task(engine.generate([long_prompt], greedy, on_token))
    await started.wait()
    (second,) = await engine.generate([short_prompt], dataclasses.replace(greedy, max_new_tokens=10))
    assert not first.done()  # it joined and left while the first one was still decoding
    (first_out,) = await first
    joined = forwards.index((1, (len(short_prompt),)))  # the newcomer's prefill rides in a decode step
    assert forwards[joined - 1] == (1, ()) and forwards[joined + 1] == (2, ())
    assert first_out.token_ids == greedy_alone(tiny_model, tokenizer, long_prompt, 120).token_ids
    assert second.token_ids == greedy_alone(tiny_model, tokenizer, short_prompt, 10).token_ids
    assert_logprobs_match_a_plain_forward(tiny_model, [long_prompt, short_prompt], [first_out, second])


def test_next_turn_prefills_only_what_the_environment_added(engine, tiny_model, tokenizer, forwards):
    system = tokenizer.encode(SYSTEM)
    turn1 = system + tokenizer.encode("What is 12 * 34?")
    (out1,) = gen(engine, [turn1], max_new_tokens=20, temperature=1.0)
    tool = tokenizer.encode("\n<tool_response>408</tool_response>\n")
    turn2 = turn1 + out1.token_ids + tool
    before = dict(engine.stats)
    forwards.clear()
    (out2,) = gen(engine, [turn2], max_new_tokens=20, temperature=1.0)
    held = len(turn1) + len(out1.token_ids) - 1  # the last sampled token was never fed to the model
    assert engine.stats["reused"] - before["reused"] == held
    assert forwards[0] == (0, (len(tool) + 1,))  # the prefill: the last sampled token and the tool result
    assert_logprobs_match_a_plain_forward(tiny_model, [turn2], [out2])
    assert engine._parked[0].tokens == (turn2 + out2.token_ids)[:-1]  # turn 1's slot was taken over, not copied


def test_a_rewritten_context_reuses_only_the_common_beginning(engine, tiny_model, tokenizer):
    system = tokenizer.encode(SYSTEM)
    gen(engine, [system + tokenizer.encode("What is 12 * 34?")], max_new_tokens=20, temperature=1.0)
    rewritten = system + tokenizer.encode("Summary so far: the user asked for a product.")
    before = engine.stats["reused"]
    (out2,) = gen(engine, [rewritten], max_new_tokens=20, temperature=1.0)
    first = system + tokenizer.encode("What")
    common = next(i for i, (a, b) in enumerate(zip(rewritten, first, strict=False)) if a != b)
    assert engine.stats["reused"] - before == common
    assert_logprobs_match_a_plain_forward(tiny_model, [rewritten], [out2])
    assert len(engine._parked) == 2  # a partial match copies keys and leaves the first entry parked


def test_a_shared_beginning_stays_found_after_the_entry_it_was_indexed_under_leaves(engine, tokenizer):
    """Two parked conversations share the system prompt; its block keys point to the newer one. When
    that one is evicted, a new prompt must still find the system prompt's keys in the older one."""
    system = tokenizer.encode(SYSTEM)
    gen(engine, [system + tokenizer.encode("What is 12 * 34?")], max_new_tokens=4, temperature=0.0)
    gen(engine, [system + tokenizer.encode("Name a colour.")], max_new_tokens=4, temperature=0.0)
    older, newer = sorted(engine._parked, key=lambda e: e.stamp)
    with torch.inference_mode():  # the engine's thread moves keys in inference mode
        engine._evict(newer)
    entry, m = engine._lookup(system + tokenizer.encode("Why?"), 10_000)
    assert entry is older and m >= len(system)


def test_greedy_turns_equal_a_fresh_engine_under_a_tiny_memory_budget(tiny_model, tokenizer):
    """Three-turn greedy conversations for 6 prompts through an engine whose KV budget holds only a few
    slots: parked keys are evicted and recomputed, and every answer is what a fresh engine gives."""
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32 bytes
    small = LocalEngine(tiny_model, tokenizer, seed=0, max_context=1024, kv_cache_gb=4 * 256 * per_token / 2**30)
    prompts = [tokenizer.encode(SYSTEM + q) for q in ("Hi", "2+2", "Name a colour", "Why?", "Go", "Stop")]
    tail = tokenizer.encode(" ok, go on:")
    for _turn in range(3):
        outs = gen(small, prompts, max_new_tokens=6, temperature=0.0)
        for p, o in zip(prompts, outs, strict=True):
            assert o.token_ids == greedy_alone(tiny_model, tokenizer, p, 6).token_ids
        assert small._cache.nbytes <= small.kv_cache_bytes
        prompts = [p + o.token_ids + tail for p, o in zip(prompts, outs, strict=True)]
    assert small.stats["reused"] > 0 and len(small._parked) < 6  # some kept, some evicted


def test_a_kv_budget_the_machine_cannot_hold_is_capped_with_a_warning(tiny_model, tokenizer, monkeypatch, caplog):
    """The cache grows lazily, so kv_cache_gb=4 on a laptop with 3 GB free used to surface as the OS killing
    the process mid-eval. The engine now takes at most half the memory free when it starts, and says so."""
    prompt = tokenizer.encode(SYSTEM + "Hi")
    expected = greedy_alone(tiny_model, tokenizer, prompt, 4).token_ids
    free = 3 * 2**30
    monkeypatch.setattr(local_engine, "free_host_memory", lambda: free)
    with caplog.at_level(logging.WARNING, logger="agent_r1"):
        capped = LocalEngine(tiny_model, tokenizer, kv_cache_gb=4)
    assert [r.getMessage() for r in caplog.records] == [
        "kv_cache_gb=4 is more than half the cpu memory free now (3.0 GiB): the engine keeps at most 1.5 GiB of "
        "keys and values"
    ]
    assert capped.kv_cache_bytes == free // 2
    assert gen(capped, [prompt], max_new_tokens=4, temperature=0.0)[0].token_ids == expected
    free = 10 * 2**30
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agent_r1"):
        assert LocalEngine(tiny_model, tokenizer, kv_cache_gb=4).kv_cache_bytes == 4 * 2**30
    assert not caplog.records  # a budget that fits is taken as given, silently
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6 * 2**30, 80 * 2**30))  # (free, total)
    with caplog.at_level(logging.WARNING, logger="agent_r1"):
        assert local_engine.kv_budget(4, torch.device("cuda", 0)) == 3 * 2**30  # on a GPU, its free memory
    assert "half the cuda memory free now (6.0 GiB)" in caplog.text


def test_free_host_memory_is_the_smaller_of_the_machines_and_the_cgroups(tmp_path, monkeypatch):
    """In a container or a Slurm job the OOM killer acts at a cgroup's limit, whatever the machine has
    free. 10 GiB available; the job's cgroup, above the process's own, has a 6 GiB limit with 3 GiB used, of
    which 1 GiB is inactive page cache: 4 GiB are left. The same under cgroup v1's memory controller."""
    monkeypatch.setattr(local_engine.psutil, "virtual_memory", lambda: type("vm", (), {"available": 10 * 2**30})())
    root, membership = tmp_path / "cgroup", tmp_path / "membership"
    free = lambda: local_engine.free_host_memory(root, membership)  # noqa: E731
    assert free() == 10 * 2**30  # not Linux: the machine's figure
    membership.write_text("0::/job/step\n")
    assert free() == 10 * 2**30  # no cgroup files: the machine's figure
    job, step = root / "job", root / "job" / "step"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")  # the process's own cgroup sets no limit
    (job / "memory.max").write_text(f"{6 * 2**30}\n")
    (job / "memory.current").write_text(f"{3 * 2**30}\n")
    (job / "memory.stat").write_text(f"anon {2 * 2**30}\ninactive_file {2**30}\nactive_file 0\n")
    assert free() == 4 * 2**30
    (job / "memory.current").write_text(f"{8 * 2**30}\n")  # past its limit: nothing to spare
    assert free() == 0
    v1 = root / "memory" / "box"
    v1.mkdir(parents=True)
    membership.write_text("4:memory:/box\n1:cpu:/\n")
    (v1 / "memory.limit_in_bytes").write_text(f"{5 * 2**30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2 * 2**30}\n")
    (v1 / "memory.stat").write_text(f"inactive_file 0\ntotal_inactive_file {2**30}\n")
    assert free() == 4 * 2**30
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert free() == 10 * 2**30


async def test_rows_with_different_sampling_params_share_a_batch(engine, tokenizer, forwards):
    prompts = prompts_of(tokenizer)
    kinds = [
        SamplingParams(max_new_tokens=8, temperature=0.0),
        SamplingParams(max_new_tokens=8, temperature=0.7, seed=11),
        SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=12),
    ]
    together = await asyncio.gather(*(engine.generate([p], k) for p, k in zip(prompts, kinds, strict=True)))
    assert len(forwards[0][1]) == 3  # one prefill for all three
    engine.sleep()
    for p, k, (out,) in zip(prompts, kinds, together, strict=True):
        (alone,) = await engine.generate([p], k)
        assert alone.token_ids == out.token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, out.logprobs, strict=True)) < 1e-4


def data_ptr(t: torch.Tensor) -> int | None:
    """Where a tensor's memory is; None for one without memory of its own (a FakeTensor that an earlier test's
    tracing left alive in this process)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def test_sleep_frees_the_kv_memory(engine, tokenizer):
    """After `sleep` no tensor on the KV buffer's memory is alive (a layer that kept a view of it kept
    1.5 GB through the demo's update), and the next request allocates again."""
    import gc
    import weakref

    gen(engine, prompts_of(tokenizer), max_new_tokens=4, temperature=0.0)
    ptrs = {b.untyped_storage().data_ptr() for b in engine._cache.buf}  # each layer's buffer
    tensors = [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    on_buffer = [weakref.ref(t) for t in tensors if data_ptr(t) in ptrs]  # a buffer, any view
    del tensors
    engine.sleep()
    gc.collect()
    assert all(t() is None for t in on_buffer)
    gen(engine, prompts_of(tokenizer)[:1], max_new_tokens=4, temperature=0.0)
    assert engine._cache.buf is not None


def test_changed_weights_drop_the_kept_keys(tokenizer):
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=0)
    engine = LocalEngine(model, tokenizer, seed=0, max_context=1024)
    prompt = tokenizer.encode(SYSTEM + "Hi")
    (out,) = gen(engine, [prompt], max_new_tokens=8, temperature=0.0)
    assert engine._parked
    with torch.no_grad():  # an optimizer step on the shared model, then the trainer's sync
        for p in model.parameters():
            p.mul_(1.05)
    engine.sync_weights(model)
    assert engine._parked == [] and engine._cache.buf is None  # stale keys dropped, memory freed
    nxt = prompt + out.token_ids + tokenizer.encode(" and?")
    (again,) = gen(engine, [nxt], max_new_tokens=8, temperature=0.0)
    assert_logprobs_match_a_plain_forward(model, [nxt], [again])
    other = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=5)
    engine.load_weights(other.state_dict())
    assert engine._parked == []
    (after,) = gen(engine, [nxt + again.token_ids], max_new_tokens=8, temperature=0.0)
    assert_logprobs_match_a_plain_forward(other, [nxt + again.token_ids], [after])


def test_a_full_batch_of_next_turns_keeps_every_parked_slot(tiny_model, tokenizer):
    """As many trajectories as the batch holds: every next turn continues a parked slot, and none of
    those slots is evicted to make room for the very rows that continue them."""
    engine = LocalEngine(tiny_model, tokenizer, seed=0, max_context=1024, max_batch_size=4)
    turn1 = [tokenizer.encode(SYSTEM + q) for q in ("Hi", "2+2", "Name a colour", "Why?")]
    outs = gen(engine, turn1, max_new_tokens=6, temperature=1.0)
    tool = tokenizer.encode(" ok, go on:")
    turn2 = [p + o.token_ids + tool for p, o in zip(turn1, outs, strict=True)]
    before = dict(engine.stats)
    outs2 = gen(engine, turn2, max_new_tokens=6, temperature=1.0)
    assert engine.stats["prefilled"] - before["prefilled"] == 4 * (len(tool) + 1)
    assert_logprobs_match_a_plain_forward(tiny_model, turn2, outs2)


def test_weights_loaded_between_tokens_reach_a_running_answer_and_each_token_says_which(tokenizer):
    """Asynchronous RL's partial rollouts: an update lands at a token boundary of an answer in progress.
    Each token's version says which weights sampled it, and its log-prob is exactly what those weights give
    over the keys the answer holds: the prompt and the tokens before the switch computed by the old weights
    (PipelineRL's in-flight update), the rest by the new. A plain forward rebuilds that mix and agrees."""
    import threading

    from tests.conftest import make_tiny_llama

    old = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=0)
    new = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=7)
    engine = LocalEngine(copy.deepcopy(old), tokenizer, seed=0, max_context=1024)
    prompt = tokenizer.encode(SYSTEM + "Count to twenty:")
    reached, swapped = threading.Event(), []

    def hook(i: int, token: int, logprob: float) -> bool:
        if len(hook.seen) == 5:  # the decode thread dawdles here, so the update is waiting when it returns
            reached.set()
            time.sleep(0.3)
        hook.seen.append(token)
        return True

    hook.seen = []
    updater = threading.Thread(
        target=lambda: reached.wait(30) and swapped.append(engine.load_weights(new.state_dict(), between_tokens=True))
    )
    updater.start()
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    (out,) = engine.generate_batch([prompt], params, seeds=[3], on_token=hook)
    updater.join()
    assert swapped and out.finish_reason == "length"  # the answer did not wait for the update to finish
    assert out.versions == sorted(out.versions) and set(out.versions) == {0, 1}
    j = out.versions.index(1)  # the first token the new weights sampled
    assert 5 <= j < len(out.token_ids)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        before = old(ids[:, : len(prompt) + j - 1], use_cache=True)  # keys and tokens 0 .. j-1: the old weights
        head = before.logits[0, len(prompt) - 1 :]
        tail = new(ids[:, len(prompt) + j - 1 :], past_key_values=before.past_key_values).logits[0]  # j .. end
    logits = torch.cat([head, tail])[: len(out.token_ids)]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
    assert engine.weights_version == 1 and engine.idle


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decoding_rows(tiny_model, tokenizer, forwards):
    """With a budget of 8 prompt tokens a pass, three prompts are prefilled 8 tokens at a time, oldest
    first; a prompt whose last chunk is in decodes from the next pass on, beside the chunks of the others;
    the answers are those of an engine that prefills each prompt whole."""
    chunked = LocalEngine(tiny_model, tokenizer, seed=0, max_context=1024, max_prefill_tokens=8)
    prompts = [tokenizer.encode(SYSTEM + q)[:n] for q, n in (("Hi", 12), ("2+2", 21), ("Go on", 9))]
    outs = gen(chunked, prompts, max_new_tokens=6, temperature=0.0)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == greedy_alone(tiny_model, tokenizer, p, 6).token_ids
    assert forwards[:6] == [(0, (8,)), (0, (4, 4)), (1, (8,)), (1, (8,)), (1, (1, 7)), (2, (2,))]
    assert forwards[6] == (3, ())  # 12 + 21 + 9 = 42 tokens in six passes, then all three decode
    assert_logprobs_match_a_plain_forward(tiny_model, prompts, outs)


def tiny_gemma3(tokenizer, layer_types: list[str]):
    """A 2-layer Gemma 3 whose sliding layers see 6 columns, seeded."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        layer_types=layer_types, max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return Gemma3ForCausalLM(config).eval()


def test_sliding_window_layers_see_only_their_window(tokenizer):
    """Gemma 3 alternates sliding-window and full layers: a key more than `sliding_window` positions back
    is hidden in the sliding ones, in decode rows and prompt chunks alike. The engine's log-probs are a
    plain forward's (transformers' own masks) well past the window."""
    model = tiny_gemma3(tokenizer, ["sliding_attention", "full_attention"])
    engine = LocalEngine(model, tokenizer, seed=0, max_context=1024, max_prefill_tokens=5)
    prompts = [tokenizer.encode(SYSTEM)[:n] for n in (13, 7)]
    outs = gen(engine, prompts, max_new_tokens=12, temperature=1.0)
    assert_logprobs_match_a_plain_forward(model, prompts, outs)
    model.config.sliding_window = 1024  # the same model without the window: other log-probs
    with pytest.raises(AssertionError):
        assert_logprobs_match_a_plain_forward(model, prompts, outs)


@pytest.mark.parametrize("max_prefill_tokens, widest", [(5, 5 + 6 - 1), (1024, 2 * 6 - 1)])
def test_sliding_window_layers_read_only_their_window(tokenizer, monkeypatch, max_prefill_tokens, widest, decode_path):
    """A sliding-window layer's attention reads only the columns its tokens can see, not the whole
    context. Every layer here slides over 6 columns, and a sequence grows to 25 tokens. The CPU kernel
    reads each token's window alone (6 columns), a prompt's tokens as a decode row's. Through SDPA,
    prefilled in 5-token chunks, a call reads at most a chunk and the window of its first token (10
    columns); prefilled whole, the 13-token prompt is cut into blocks of 6 queries, each reading at most
    2 x 6 - 1 columns; a decode row reads 6. Rows of different lengths decoding together still get a
    plain forward's log-probs."""
    model = tiny_gemma3(tokenizer, ["sliding_attention", "sliding_attention"])
    widths = []
    sdpa = kv_cache.F.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        widths.append(k.shape[2])  # [rows, Hkv, W, D]: the columns this call reads
        return sdpa(q, k, v, **kwargs)

    bounds = kv_cache.Segment.bounds

    def kernel_reads(self, window):  # the tokens the kernel takes
        start, end = bounds(self, window)
        widths.append(int((end - start).max()))
        return start, end

    monkeypatch.setattr(kv_cache.F, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(kv_cache.Segment, "bounds", kernel_reads)
    engine = LocalEngine(model, tokenizer, seed=0, max_context=1024, max_prefill_tokens=max_prefill_tokens)
    engine.eos_ids = {-1}  # the sequence decodes all 12 tokens
    prompt = tokenizer.encode(SYSTEM)[:13]
    (out,) = gen(engine, [prompt], max_new_tokens=12, temperature=1.0)
    monkeypatch.setattr(kv_cache.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(kv_cache.Segment, "bounds", bounds)
    assert len(prompt) + len(out.token_ids) == 25
    assert widths and max(widths) == (6 if decode_path == "kernel" else widest)
    assert widths[-1] == 6  # the last decode step: the window, of 24 columns
    assert_logprobs_match_a_plain_forward(model, [prompt], [out])
    prompts = [tokenizer.encode(SYSTEM)[:n] for n in (13, 7)]
    outs = gen(engine, prompts, max_new_tokens=12, temperature=1.0)
    assert_logprobs_match_a_plain_forward(model, prompts, outs)


def test_a_running_slot_opens_in_a_full_buffer_and_the_parked_keys_move_intact(tiny_model, tokenizer):
    """`_fit` counts ahead the slots an admission needs. A prompt that meant to take a parked sequence over
    but copies a longer-matching shared prefix instead needs one slot more: opening a running slot in a
    full buffer grows it, and the parked sequence moves with its keys (before: an IndexError, in 64 of the
    128 episodes of the reasoning-gym eval after SFT)."""
    engine = LocalEngine(tiny_model, tokenizer, seed=0)
    cache = engine._slots()
    cache.reserve(2, 32)  # two slots, both taken: a running row and a parked sequence
    cache.read_up_to(32)
    for layer in cache.buf:
        layer[:, 1, :, :20] = 7.0
    row = local_engine._Seq([5] * 8, SamplingParams(), 0, None, 0, None, None, None)
    parked = local_engine._Parked(list(range(20)), 1, [], 0)
    engine._running, engine._parked, engine._slot = [row], [parked], [row, parked]
    row.slot = 0
    assert engine._open_running_slot() == 1
    assert cache.slots == 3 and parked.slot == 2 and engine._slot == [row, None, parked]
    assert all((layer[:, 2, :, :20] == 7.0).all() for layer in cache.buf)


KILLED_MID_DECODE = """
import threading, time
from transformers import AutoTokenizer
from agent_r1.cli import exit_on_sigterm
from agent_r1.models.loading import resolve_model_path
from agent_r1.engines.protocol import SamplingParams
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.utils import malloc
from tests.conftest import make_tiny_llama

exit_on_sigterm()
tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
engine = LocalEngine(make_tiny_llama(len(tok), hidden=256), tok, max_context=100000)
params = SamplingParams(max_new_tokens=50000, temperature=1.0)
generate = lambda: engine.generate_batch([tok.encode("Hello")] * 8, params, seeds=list(range(8)))
threading.Thread(target=generate, daemon=True).start()
while engine.stats["decode_steps"] < 3:
    time.sleep(0.01)
print("decoding", flush=True)
time.sleep(600)
"""


def test_sigterm_mid_decode_exits_143_not_an_abort():
    """`agent-r1 train` killed mid-rollout exited 134 ("terminate called without an active exception"):
    the daemon decode thread was inside a forward pass while the interpreter tore torch down. The engine
    now stops its decode thread at exit, so the kill ends as SIGTERM should (128 + 15)."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_DECODE],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "decoding", proc.stderr.read()
        time.sleep(0.5)  # well inside the decode loop
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        assert rc == 128 + signal.SIGTERM, f"exit {rc}: {proc.stderr.read()[-500:]}"
    finally:
        proc.kill()


LEFT_WHILE_THE_THREAD_ENDS = """
import atexit, ctypes, threading
atexit.register(lambda: print("alive", sum(t.name == "agent-r1-decode" for t in threading.enumerate())))  # runs last
from transformers import AutoTokenizer
from agent_r1.models.loading import resolve_model_path
from agent_r1.engines.protocol import SamplingParams
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.utils import malloc
from tests.conftest import make_tiny_llama

libc = ctypes.CDLL(None)
malloc.trim_heap = lambda: libc.usleep(1_000_000)  # the thread's last malloc_trim is slow (and frees the GIL)
tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
engine = LocalEngine(make_tiny_llama(len(tok), hidden=32), tok)
engine.generate_batch([tok.encode("Hello")], SamplingParams(max_new_tokens=4), seeds=[0])
assert engine.wait_idle()
"""


def test_the_interpreter_exits_only_after_the_decode_thread_has_ended():
    """`agent-r1 chat --prompt` aborted in ~1 of 45 runs on a loaded machine ("terminate called without an
    active exception"): once idle, the decode thread still left its heap and then freed the engine it held,
    and when the main thread had already let the engine go, those tensors were freed while the interpreter
    was being finalized. At exit every decode thread is now joined, however far it has got."""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-c", LEFT_WHILE_THE_THREAD_ENDS],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-1000:]
    assert out.stdout.split() == ["alive", "0"], out.stdout + out.stderr[-1000:]
