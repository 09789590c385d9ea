"""Losses against direct computations: loops over tokens in plain Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from agent_r1.algos.losses import (
    aggregate,
    entropy_from_logits,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    value_loss,
)


def T(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def ref_ppo_token(lp: float, olp: float, a: float, lo: float, hi: float, dual: float | None) -> float:
    """-min(r A, clip(r) A), capped at -dual * A when A < 0."""
    r = math.exp(lp - olp)
    loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    if dual is not None and a < 0:
        loss = min(loss, -dual * a)
    return loss


def ref_aggregate(per_tok: list[float], mask: list[float], seq: list[int], mode: str, norm_len=None) -> float:
    if mode == "token-mean":
        return sum(x * m for x, m in zip(per_tok, mask, strict=True)) / sum(mask)
    by_seq: dict[int, list[float]] = {}
    for x, m, s in zip(per_tok, mask, seq, strict=True):
        if m:
            by_seq.setdefault(s, []).append(x)
    if mode == "seq-mean-token-mean":
        return sum(sum(v) / len(v) for v in by_seq.values()) / len(by_seq)
    return sum(sum(v) / norm_len for v in by_seq.values()) / len(by_seq)


# 8 tokens, 3 sequences (ids 7, 2, 9); token 3 is a prompt token with a junk id and junk log-prob.
LOGP = [-0.5, -1.0, -2.0, -40.0, -0.3, -0.9, -1.5, -0.1]
OLD = [-1.0, -0.5, -2.0, 0.0, -0.8, -0.4, -3.5, -0.1]
ADV = [1.0, 1.0, 1.0, 5.0, -1.0, -1.0, -2.0, 0.5]
MASK = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
SEQ = [7, 7, 7, -1, 2, 2, 9, 9]


def batch():
    return T(*LOGP), T(*OLD), T(*ADV), T(*MASK), torch.tensor(SEQ)


def test_ppo_clip_both_sides_golden():
    # token 0: r = e^0.5 = 1.6487, A = 1  -> clip at 1.2 -> loss -1.2 (clipped)
    # token 5: r = e^-0.5 = 0.6065, A = -1 -> max(0.6065, 0.8) = 0.8 (clipped)
    # token 2: r = 1 -> -1 (not clipped)
    lp, olp, a, m, s = T(-0.5, -0.9, -2.0), T(-1.0, -0.4, -2.0), T(1.0, -1.0, 1.0), T(1, 1, 1), T(0, 0, 0)
    loss, metrics = ppo_policy_loss(lp, olp, a, m, s.long())
    assert float(loss) == pytest.approx((-1.2 + 0.8 - 1.0) / 3)
    assert metrics["clip_frac"] == pytest.approx(2 / 3)
    assert metrics["ratio_max"] == pytest.approx(math.exp(0.5))
    # k3 of KL(old || new): mean of (r - 1) - log r
    k3 = [math.exp(d) - 1 - d for d in (0.5, -0.5, 0.0)]
    assert metrics["approx_kl"] == pytest.approx(sum(k3) / 3)


@pytest.mark.parametrize(("lo", "hi"), [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_ppo_asymmetric_clip_matches_loop(lo, hi):
    lp, olp, a, m, s = batch()
    loss, metrics = ppo_policy_loss(lp, olp, a, m, s, clip_low=lo, clip_high=hi)
    per = [ref_ppo_token(*x, lo, hi, None) for x in zip(LOGP, OLD, ADV, strict=True)]
    assert float(loss) == pytest.approx(ref_aggregate(per, MASK, SEQ, "token-mean"))
    clipped = [
        m and (-a * min(max(math.exp(x - o), 1 - lo), 1 + hi) > -a * math.exp(x - o))
        for x, o, a, m in zip(LOGP, OLD, ADV, MASK, strict=True)
    ]
    assert metrics["clip_frac"] == pytest.approx(sum(clipped) / 7)


def test_asymmetric_clip_golden():
    # r = e^0.22 = 1.246, A = 1: clip-higher 0.28 lets it through (-1.246), symmetric 0.2 clips to -1.2
    lp, olp, a, m, s = T(-0.78), T(-1.0), T(1.0), T(1.0), torch.tensor([0])
    sym, _ = ppo_policy_loss(lp, olp, a, m, s)
    dapo, _ = ppo_policy_loss(lp, olp, a, m, s, clip_high=0.28)
    assert float(sym) == pytest.approx(-1.2)
    assert float(dapo) == pytest.approx(-math.exp(0.22))


def test_dual_clip():
    # token 6: r = e^2 = 7.389, A = -2 -> PPO loss max(14.78, 2.4) = 14.78 ; dual clip c = 3 caps at 6
    lp, olp, a, m, s = batch()
    loss, metrics = ppo_policy_loss(lp, olp, a, m, s, dual_clip=3.0)
    per = [ref_ppo_token(*x, 0.2, 0.2, 3.0) for x in zip(LOGP, OLD, ADV, strict=True)]
    assert per[6] == 6.0
    assert float(loss) == pytest.approx(ref_aggregate(per, MASK, SEQ, "token-mean"))
    assert metrics["dual_clip_frac"] == pytest.approx(1 / 7)
    # the capped token gets no gradient
    lp.requires_grad_(True)
    ppo_policy_loss(lp, olp, a, m, s, dual_clip=3.0)[0].backward()
    assert lp.grad[6] == 0.0
    with pytest.raises(ValueError):
        ppo_policy_loss(lp, olp, a, m, s, dual_clip=1.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_modes(mode):
    lp, olp, a, m, s = batch()
    loss, _ = ppo_policy_loss(lp, olp, a, m, s, agg=mode, norm_len=4.0)
    per = [ref_ppo_token(*x, 0.2, 0.2, None) for x in zip(LOGP, OLD, ADV, strict=True)]
    assert float(loss) == pytest.approx(ref_aggregate(per, MASK, SEQ, mode, norm_len=4.0))


def test_aggregate_golden_and_errors():
    loss, mask, seq = T(1.0, 2.0, 3.0, 100.0, 6.0), T(1, 1, 1, 0, 1), torch.tensor([0, 0, 1, 5, 1])
    assert float(aggregate(loss, mask, seq, "token-mean")) == pytest.approx(12 / 4)
    # seq 0: mean 1.5, seq 1: mean 4.5 -> (1.5 + 4.5)/2
    assert float(aggregate(loss, mask, seq, "seq-mean-token-mean")) == pytest.approx(3.0)
    # seq sums 3 and 9, /norm_len 10, /2 seqs
    assert float(aggregate(loss, mask, seq, "seq-mean-token-sum-norm", norm_len=10)) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(loss, mask, seq, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(loss, mask, seq, "seq-sum")  # type: ignore[arg-type]
    # nan/inf off the mask never leaks into the loss
    bad = T(1.0, 2.0, 3.0, math.nan, 6.0)
    assert float(aggregate(bad, mask, seq, "seq-mean-token-mean")) == pytest.approx(3.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("fn", [ppo_policy_loss, gspo_policy_loss])
def test_gradient_accumulation_equivalence(mode, fn):
    lp, olp, a, m, s = batch()
    full, _ = fn(lp, olp, a, m, s, agg=mode, norm_len=4.0)
    n_tokens, n_seqs = float(m.sum()), 3.0
    halves = [slice(0, 4), slice(4, 8)]  # split at a sequence boundary
    total = sum(
        fn(lp[h], olp[h], a[h], m[h], s[h], agg=mode, norm_len=4.0, n_tokens=n_tokens, n_seqs=n_seqs)[0] for h in halves
    )
    assert float(total) == pytest.approx(float(full))
    # and gradients agree too
    lp1 = lp.clone().requires_grad_(True)
    fn(lp1, olp, a, m, s, agg=mode, norm_len=4.0)[0].backward()
    lp2 = lp.clone().requires_grad_(True)
    for h in halves:
        kw = {"agg": mode, "norm_len": 4.0, "n_tokens": n_tokens, "n_seqs": n_seqs}
        fn(lp2[h], olp[h], a[h], m[h], s[h], **kw)[0].backward()
    assert torch.allclose(lp1.grad, lp2.grad)


def test_gspo_sequence_ratio_and_gradient():
    # seq 0: log-ratios 0.1, -0.3 -> s0 = exp(-0.1) ; seq 1: log-ratio 0.2 -> s1 = exp(0.2)
    lp = T(-1.0, -2.3, -0.5, 9.9).requires_grad_(True)
    olp, a, m, s = T(-1.1, -2.0, -0.7, 0.0), T(1.0, 1.0, 2.0, 1.0), T(1, 1, 1, 0), torch.tensor([0, 0, 1, 3])
    loss, metrics = gspo_policy_loss(lp, olp, a, m, s, clip_low=10.0, clip_high=10.0)  # no clipping
    s0, s1 = math.exp(-0.1), math.exp(0.2)
    # seq-mean-token-mean of -A s: seq 0 -> -s0, seq 1 -> -2 s1
    assert loss.item() == pytest.approx((-s0 - 2 * s1) / 2)
    assert metrics["seq_ratio_max"] == pytest.approx(s1)
    loss.backward()
    # d/dlogp_t = -A_t s_i / |y_i| / n_seqs: positive advantage -> descending the loss raises logp
    assert lp.grad.tolist() == pytest.approx([-s0 / 2 / 2, -s0 / 2 / 2, -2 * s1 / 2, 0.0])


def test_gspo_tiny_clip():
    # sequence log-ratio 0.01 -> s = 1.01 > 1 + 4e-4 with A > 0: clipped to -(1 + 4e-4), no gradient
    lp = T(-0.99, -1.99).requires_grad_(True)
    olp, a, m, s = T(-1.0, -2.0), T(1.0, 1.0), T(1, 1), torch.tensor([4, 4])
    loss, metrics = gspo_policy_loss(lp, olp, a, m, s)
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert metrics["clip_frac"] == 1.0
    loss.backward()
    assert lp.grad.abs().max() == 0.0
    # the token-level PPO ratio exp(0.01) would be unclipped at 0.2
    assert ppo_policy_loss(lp, olp, a, m, s)[1]["clip_frac"] == 0.0


def test_kl_estimators():
    lp, ref = T(-1.0, -0.5, -2.0), T(-1.5, -0.5, -1.0)
    d = [0.5, 0.0, -1.0]  # logp - ref
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx(d)
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.5 * x * x for x in d])
    k3 = [math.exp(-x) - (-x) - 1 for x in d]  # exp(ref - logp) - (ref - logp) - 1
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx(k3)
    assert min(k3) >= 0.0
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")  # type: ignore[arg-type]


def test_value_loss_clipped():
    # tok 0: v 1.0, old 0.5, R 1.2: clipped v = 0.7 -> 0.5 * max(0.04, 0.25) = 0.125 (clip active)
    # tok 1: v 0.6, old 0.5, R 1.2: inside the range -> 0.5 * 0.36 = 0.18
    # tok 2: v 0.0, old 0.5, R 0.0: clipped v = 0.3 -> 0.5 * max(0, 0.09) = 0.045 (clip active)
    # tok 3: masked out
    v, old, ret = T(1.0, 0.6, 0.0, 50.0), T(0.5, 0.5, 0.5, 0.0), T(1.2, 1.2, 0.0, 0.0)
    m, s = T(1, 1, 1, 0), torch.tensor([0, 0, 1, 1])
    loss, metrics = value_loss(v, old, ret, m, s, clip=0.2)
    assert float(loss) == pytest.approx((0.125 + 0.18 + 0.045) / 3)
    assert metrics["vf_clip_frac"] == pytest.approx(2 / 3)
    # seq-mean-token-mean: seq 0 (0.125 + 0.18)/2, seq 1 0.045
    loss, _ = value_loss(v, old, ret, m, s, clip=0.2, agg="seq-mean-token-mean")
    assert float(loss) == pytest.approx(((0.125 + 0.18) / 2 + 0.045) / 2)
    unclipped, _ = value_loss(v, old, ret, m, s, clip=None)
    assert float(unclipped) == pytest.approx((0.5 * 0.04 + 0.18 + 0.0) / 3)


def test_entropy():
    assert entropy_from_logits(torch.zeros(3, 50)).tolist() == pytest.approx([math.log(50)] * 3)
    z = [2.0, -1.0, 0.5]
    p = [math.exp(x) / sum(math.exp(y) for y in z) for y in [0] for x in z]
    assert float(entropy_from_logits(T(*z))) == pytest.approx(-sum(q * math.log(q) for q in p))
    # huge logits stay finite: one dominant entry -> entropy ~ 0; shifted uniform stays log V
    big = entropy_from_logits(torch.tensor([[1e4, 0.0, -1e4], [1e4, 1e4, 1e4]]))
    assert torch.isfinite(big).all()
    assert big.tolist() == pytest.approx([0.0, math.log(3)], abs=1e-5)
