"""The CUDA / bf16 path, on the bundled model: skipped without a GPU (CI has none; run them on one with
`pytest -m gpu`). The CPU suite proves the device handling itself (tests/models/test_precision.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from agent_r1.models.loading import load_model
from agent_r1.rollout.engine import SamplingParams
from agent_r1.rollout.local_engine import LocalEngine
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
