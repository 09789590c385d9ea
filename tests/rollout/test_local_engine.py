import asyncio
import dataclasses

import pytest
import torch

from agent_r1.rollout.engine import SamplingParams
from tests.conftest import recompute_logprobs


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


def test_sampled_logprobs_match_a_plain_forward(engine, tiny_model, tokenizer):
    prompts = prompts_of(tokenizer)
    for temperature in (1.0, 0.7):
        outs = gen(engine, prompts, max_new_tokens=16, temperature=temperature)
        for p, o in zip(prompts, outs, strict=True):
            ref = recompute_logprobs(tiny_model, p + o.token_ids, temperature)[len(p) - 1 :]
            assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 1e-4


def test_seeded_rows_do_not_depend_on_batch_company(engine, tokenizer):
    prompts = prompts_of(tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    alone = engine.generate_batch(prompts[:1], params, seeds=[42])
    together = engine.generate_batch(prompts, params, seeds=[42, 7, 8])
    again = engine.generate_batch(prompts[:1], params, seeds=[42])
    other = engine.generate_batch(prompts[:1], params, seeds=[43])
    assert alone[0].token_ids == together[0].token_ids == again[0].token_ids
    assert other[0].token_ids != alone[0].token_ids


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


async def test_concurrent_calls_are_batched_together(engine, tokenizer):
    calls = []
    original = engine.generate_batch
    engine.generate_batch = lambda prompts, params, seeds, hook: (
        calls.append(len(prompts)) or original(prompts, params, seeds, hook)
    )
    prompts = prompts_of(tokenizer)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    outs = await asyncio.gather(*(engine.generate([p], params) for p in prompts))
    assert calls == [3]
    assert all(len(o[0].token_ids) == 4 for o in outs)


async def test_on_token_streams_every_sampled_token_in_order(engine, tokenizer):
    prompts = prompts_of(tokenizer)[:2]
    seen: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    outs = await engine.generate(prompts, params, on_token=lambda i, tok, lp: seen[i].append((tok, lp)))
    for i, out in enumerate(outs):
        assert [t for t, _ in seen[i]] == out.token_ids and [lp for _, lp in seen[i]] == out.logprobs
    assert [o.token_ids for o in outs] == [o.token_ids for o in await engine.generate(prompts, params)]


async def test_cancelled_caller_stops_its_row_and_others_finish(engine, tokenizer):
    finishes = []
    original = engine.generate_batch

    def spy(prompts, params, seeds, hook):
        outs = original(prompts, params, seeds, hook)
        finishes.extend(o.finish_reason for o in outs)
        return outs

    engine.generate_batch = spy
    first_token = asyncio.Event()
    params = SamplingParams(max_new_tokens=400, temperature=0.0)
    doomed = asyncio.create_task(engine.generate([prompts_of(tokenizer)[0]], params, lambda *_: first_token.set()))
    survivor = asyncio.create_task(engine.generate([prompts_of(tokenizer)[1]], dataclasses.replace(params, seed=1)))
    await first_token.wait()
    doomed.cancel()
    (out,) = await survivor
    assert finishes.count("abort") == 1 and len(out.token_ids) == 400  # the other row decoded to its budget
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


def generate_recording_shapes(engine, model, prompts, **kw):
    """Generate, returning the outputs and the input shape of every forward pass, in order."""
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        return gen(engine, prompts, **kw), calls
    finally:
        hook.remove()


def assert_logprobs_match_a_plain_forward(model, prompts, outs):
    for p, out in zip(prompts, outs, strict=True):
        ref = recompute_logprobs(model, p + out.token_ids)[len(p) - 1 :]
        assert (ref - torch.tensor(out.logprobs)).abs().max().item() < 1e-4


def test_shared_prefix_is_prefilled_once_and_changes_nothing(engine, tiny_model, tokenizer):
    system = tokenizer.encode(SYSTEM)
    prompts = [system + tokenizer.encode(q) for q in ("What is 12 * 34?", "Hi", "Add 5 and 7, then double it")]
    batched, calls = generate_recording_shapes(engine, tiny_model, prompts, max_new_tokens=8, temperature=1.0)
    assert calls[0] == (1, len(system)) and calls[1][0] == 3  # the prefix ran once, then only the suffixes
    assert_logprobs_match_a_plain_forward(tiny_model, prompts, batched)
    greedy = gen(engine, prompts, max_new_tokens=8, temperature=0.0)
    for p, out in zip(prompts, greedy, strict=True):
        assert out.token_ids == gen(engine, [p], max_new_tokens=8, temperature=0.0)[0].token_ids


def test_a_groups_repeated_prompt_is_prefilled_once(engine, tiny_model, tokenizer):
    system = tokenizer.encode(SYSTEM)
    a, b = (system + tokenizer.encode(q) for q in ("What is 12 * 34?", "Add 5 and 7, then double it"))
    prompts = [a, a, a, b, b]  # two GRPO groups
    outs, calls = generate_recording_shapes(engine, tiny_model, prompts, max_new_tokens=12, temperature=1.0)
    assert calls[0] == (1, len(system)) and calls[1][0] == 2  # the shared prefix, then the 2 distinct prompts
    assert calls[2] == (5, 1)  # then all 5 rows decode
    assert_logprobs_match_a_plain_forward(tiny_model, prompts, outs)
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # the copies sample independently
