"""Truncated importance sampling between rollout and trainer probabilities (golden values by hand)."""

import math

import pytest
import torch

from agent_r1.algos.off_policy import drift_metrics, truncated_is_weights
from agent_r1.trainer.batching import Row
from agent_r1.trainer.rows import apply_tis, recompute_old_logprobs
from tests.conftest import make_tiny_llama, recompute_logprobs


def test_weights_are_the_probability_ratio_capped_and_one_off_the_mask():
    old = torch.tensor([0.0, math.log(0.5), math.log(0.9), math.log(0.6), -1.0])
    rollout = torch.tensor([0.0, math.log(0.25), math.log(0.3), math.log(0.8), -5.0])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    w = truncated_is_weights(old, rollout, mask, cap=2.0)
    # p_old / p_rollout: 0.5 / 0.25 = 2 (at the cap), 0.9 / 0.3 = 3 -> 2, 0.6 / 0.8 = 0.75; off the mask 1
    assert w.tolist() == pytest.approx([1.0, 2.0, 2.0, 0.75, 1.0], rel=1e-6)


def test_drift_is_measured_on_sampled_tokens_only():
    m = drift_metrics([torch.tensor([9.0, 1.0, 2.0])], [torch.tensor([0.0, 1.5, 1.0])], [torch.tensor([0.0, 1, 1])])
    assert m == pytest.approx({"logprob_drift_mean": 0.75, "logprob_drift_max": 1.0})
    assert drift_metrics([torch.zeros(2)], [torch.ones(2)], [torch.zeros(2)]) == {}
    assert drift_metrics([], [], []) == {}  # a step whose every group was left out


def test_recomputed_old_logprobs_replace_the_engines_and_tis_scales_advantages():
    model = make_tiny_llama(64, hidden=32)
    ids = [5, 6, 7, 8, 9, 10]
    true = recompute_logprobs(model, ids)  # [5] log-prob of ids[1:]
    mask = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.float32)
    noise = torch.tensor([0, 0, 0, 0.5, -2.0, 0.1])  # the engine's numerics: one token badly off
    engine_logp = (torch.cat([torch.zeros(1), true]) + noise) * mask
    row = Row(torch.tensor(ids), mask, engine_logp.clone(), mask * 3.0, torch.zeros(6, dtype=torch.long))
    drift = recompute_old_logprobs(model, [row], 1024, 1.0)
    assert torch.allclose(row.old_logp, torch.cat([torch.zeros(1), true]) * mask, atol=1e-5)
    assert torch.equal(row.rollout_logp, engine_logp)
    assert drift == pytest.approx({"logprob_drift_mean": (0.5 + 2.0 + 0.1) / 3, "logprob_drift_max": 2.0}, abs=1e-5)
    stats = apply_tis([row], cap=2.0)
    # weights exp(-noise): e^-0.5, e^2 -> capped at 2, e^-0.1; advantages 3 each
    want = [0, 0, 0, 3 * math.exp(-0.5), 3 * 2.0, 3 * math.exp(-0.1)]
    assert row.adv.tolist() == pytest.approx(want, rel=1e-4)
    assert stats["tis_clip_frac"] == pytest.approx(1 / 3)
    assert stats["tis_weight_mean"] == pytest.approx((math.exp(-0.5) + 2 + math.exp(-0.1)) / 3, rel=1e-4)
