"""Micro-batches: packing and shared-prefix forwards give the same log-probs and gradients as
running every row on its own."""

import torch

from agent_r1.trainer.batching import Row, pack, token_logprobs
from tests.trainer.conftest import tiny_model


def row(ids, first_sampled):
    ids = torch.tensor(ids)
    mask = torch.zeros(len(ids))
    mask[first_sampled:] = 1
    return Row(ids, mask, torch.zeros(len(ids)), torch.zeros(len(ids)), torch.zeros(len(ids), dtype=torch.long))


PREFIX = list(range(3, 43))  # 40 shared tokens


def rows():
    return [
        row([*PREFIX, 50, 51, 52, 7, 8, 9], 43),
        row([*PREFIX, 50, 60, 5, 6], 42),
        row([*PREFIX, 61, 62, 63, 10, 11, 12, 13, 14], 44),
        row([1, 2, 3, 4, 5, 6], 3),  # shares nothing
    ]


def reference(model, r):
    """Per-row plain forward: log-prob of each token given its prefix, on the mask."""
    logits = model(r.input_ids[None]).logits[0, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, r.input_ids[1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp]) * r.mask


def grads_of(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_row_once_budget_respected_and_prefix_shared():
    mbs = pack(rows(), max_tokens=60)
    assert sorted(n for mb in mbs for n in mb.row_lens) == sorted(len(r.input_ids) for r in rows())
    assert all(mb.num_tokens <= 60 or len(mb.row_lens) == 1 for mb in mbs)
    shared = [mb for mb in mbs if mb.prefix_len]
    assert shared and all(mb.prefix_len == 40 for mb in shared)  # stops at the first differing token
    assert sum(mb.num_tokens for mb in mbs) < sum(len(r.input_ids) for r in rows())


def test_shared_prefix_stops_before_trainable_tokens():
    a = row([*PREFIX, 1, 2], 20)  # trainable from position 20: the prefix may not cover it
    b = row([*PREFIX, 3, 4], 41)
    (mb,) = pack([a, b], max_tokens=200, min_shared_prefix=8)
    assert mb.prefix_len == 19
    assert pack([a, b], max_tokens=200, min_shared_prefix=32)[0].prefix_len == 0  # too short to pay


def test_logprobs_and_gradients_match_rows_run_alone():
    model = tiny_model()
    data = rows()
    ref_lp = [reference(model, r) for r in data]
    ref_grads = grads_of(model, -sum(lp.sum() for lp in ref_lp))
    for budget, min_shared in ((1000, 32), (1000, 10_000), (40, 32)):  # shared prefix, packed only, one row per bin
        mbs = pack(data, max_tokens=budget, min_shared_prefix=min_shared)
        total = 0
        for mb in mbs:
            logp, _, _ = token_logprobs(model, mb)
            start = 0
            for n in mb.row_lens:
                r = next(r for r in data if len(r.input_ids) == n)
                assert torch.allclose(logp[start : start + n], reference(model, r), atol=1e-5)
                start += n
            total = total + logp.sum()
        got = grads_of(model, -total)
        for name, g in ref_grads.items():
            assert torch.allclose(got[name], g, atol=1e-5), (budget, min_shared, name)


def test_entropy_has_a_gradient_only_when_asked():
    model = tiny_model()
    (mb,) = pack(rows()[:1], max_tokens=1000)
    _, ent, _ = token_logprobs(model, mb, entropy=True)
    assert not ent.requires_grad
    _, ent, _ = token_logprobs(model, mb, entropy=True, entropy_grad=True)
    assert ent.requires_grad and float(ent.detach().sum()) > 0
    ent.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_weighted_loss_temperature_and_entropy_metric_match_plain_autograd():
    """The fused log-prob/entropy path against log_softmax + autograd, with per-token weights (like
    advantages) and a temperature."""
    model = tiny_model()
    r = rows()[0]
    weights = torch.linspace(-2.0, 3.0, len(r.input_ids)) * r.mask
    logits = model(r.input_ids[None]).logits[0, :-1] / 0.7
    logp_all = torch.log_softmax(logits, -1)
    ref_lp = torch.cat([torch.zeros(1), logp_all.gather(-1, r.input_ids[1:, None]).squeeze(-1)]) * r.mask
    ref_ent = torch.cat([torch.zeros(1), -(logp_all.exp() * logp_all).sum(-1)]) * r.mask
    ref_grads = grads_of(model, (ref_lp * weights).sum())
    (mb,) = pack([r], max_tokens=1000)
    logp, ent, _ = token_logprobs(model, mb, 0.7, entropy=True)
    assert torch.allclose(logp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    got = grads_of(model, (logp * weights).sum())
    for name, g in ref_grads.items():
        assert torch.allclose(got[name], g, atol=1e-5), name
