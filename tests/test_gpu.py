"""The CUDA / bf16 path, on the bundled model: skipped without a GPU (CI has none; run them on one with
`pytest -m gpu`). The CPU suite proves the device handling itself (tests/models/test_precision.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.models.loading import load_model
from agent_r1.trainer.rl import train
from tests.conftest import recompute_logprobs
from tests.trainer.conftest import TASKS, LowIdEnv, tiny_model, toy_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def chat_prompt(tokenizer, question):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_local_engine_on_cuda_matches_the_cpu_in_fp32():
    cpu, tokenizer = load_model("default", device="cpu")
    gpu, _ = load_model("default", device="cuda")
    prompt = chat_prompt(tokenizer, "What is 12 + 30?")
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    a = asyncio.run(LocalEngine(cpu, tokenizer).generate([prompt], params))[0]
    b = asyncio.run(LocalEngine(gpu, tokenizer).generate([prompt], params))[0]
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3


def test_bf16_rollout_drift_against_the_fp32_trainer_is_small():
    model, tokenizer = load_model("default", device="cuda", dtype="bf16", training=True)  # fp32 weights, bf16 compute
    prompt = chat_prompt(tokenizer, "Name a colour of the sky.")
    out = asyncio.run(LocalEngine(model, tokenizer, seed=0).generate([prompt] * 8, SamplingParams(48, 1.0)))
    drift = []
    model.to("cpu")
    for o in out:
        ref = recompute_logprobs(model, prompt + o.token_ids)[len(prompt) - 1 :]
        drift.append((ref - torch.tensor(o.logprobs)).abs())
    d = torch.cat(drift)
    print(json.dumps({"bf16_rollout_drift_mean": float(d.mean()), "bf16_rollout_drift_max": float(d.max())}))
    assert float(d.mean()) < 0.05


def test_a_bf16_train_step_on_cuda(tmp_path, tokenizer):
    cfg = toy_config(tmp_path, "steps=2", "device=cuda", "dtype=bf16")
    model = tiny_model()
    hist = train(cfg, model=model, tokenizer=tokenizer, make_env=LowIdEnv, tasks=TASKS)
    assert next(model.parameters()).device.type == "cuda" and next(model.parameters()).dtype == torch.float32
    assert all(h["updates"] >= 1 and h["skipped_nonfinite"] == 0 for h in hist)
    assert all("tis_weight_mean" in h and h["logprob_drift_mean"] < 0.05 for h in hist)  # bf16: recomputed + TIS
    ckpt = torch.load(next((tmp_path / "run" / "checkpoints").glob("step_*")) / "trainer_state.pt", weights_only=False)
    assert "cuda" in ckpt["torch_rng"]  # CUDA RNG state goes into checkpoints
    print(json.dumps({k: hist[-1][k] for k in ("time/rollout", "time/update", "tokens_per_s/update")}))


def test_vllm_on_cuda_sleeps_wakes_with_new_weights_and_samples_from_them():
    """vLLM with CUDA graphs and sleep mode: sample, sleep (weights to host RAM, KV cache dropped), push
    changed weights (wakes the weights, reloads, wakes the KV cache), sample again from the new ones."""
    pytest.importorskip("vllm")
    from agent_r1.engines.vllm_engine import VLLMEngine
    from agent_r1.models.loading import resolve_model_path

    model, tokenizer = load_model("default", device="cuda", training=True)
    engine = VLLMEngine(
        resolve_model_path("default"), dtype=torch.bfloat16, max_context=1024, sleep=True, enforce_eager=False,
        gpu_memory_utilization=0.3,
    )  # fmt: skip
    try:
        prompt = chat_prompt(tokenizer, "What is 12 + 30?")
        params = SamplingParams(max_new_tokens=16, temperature=0.0)
        before = asyncio.run(engine.generate([prompt], params))[0]
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert engine.asleep and torch.cuda.mem_get_info()[0] > free_awake  # the memory came back
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)  # a different policy: greedy tokens change
        engine.sync_weights(model)
        assert not engine.asleep and engine.weights_version == 1
        after = asyncio.run(engine.generate([prompt], params))[0]
        assert after.token_ids != before.token_ids and set(after.versions) == {1}
        ref = recompute_logprobs(model.float(), prompt + after.token_ids)[len(prompt) - 1 :]
        drift = (ref.cpu() - torch.tensor(after.logprobs)).abs()
        print(json.dumps({"vllm_bf16_drift_mean": float(drift.mean()), "vllm_bf16_drift_max": float(drift.max())}))
        assert float(drift.mean()) < 0.05  # the new weights sampled (the old ones would be off by nats)
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_ranks_under_torchrun_each_sample_with_vllm_on_their_own_gpu(tmp_path):
    """torchrun with 2 ranks and in-process vLLM: each rank's engine (and its current device after the engine
    started) is GPU LOCAL_RANK, and both ranks sample."""
    pytest.importorskip("vllm")
    from tests.distributed.conftest import launch

    launch(["-m", "tests.distributed.vllm_rank_worker", str(tmp_path)], nproc=2, timeout=600)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["current_device"], r["engine_device"]) for r in reports] == [(0, 0, 0), (1, 1, 1)]
    assert all(r["sampled_tokens"] > 0 for r in reports)
