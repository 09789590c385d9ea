"""`policy_update` reads nothing from the device inside a mini-batch: on a GPU every host read of a tensor
(`bool`, `float`, `int`, `item`, `tolist`, `nonzero`) waits for the queued kernels, so one per micro-batch
stalls the pipeline at every micro-batch. The metrics stay 0-d tensors until the update is over, the
sampled positions are found on the CPU while packing, and a non-finite loss is checked once per mini-batch.
Proven on a CPU by recording every host read whose caller is agent-r1's code inside the micro-batch loop
(transformers' own packed-sequence check is its business, and left alone)."""

from __future__ import annotations

import inspect
import sys
from collections import Counter

import pytest
import torch

from agent_r1.trainer.critic import Critic
from agent_r1.trainer.update import policy_update
from tests.conftest import make_tiny_llama
from tests.models.test_precision import rows
from tests.trainer.conftest import toy_config

READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "nonzero")


def loop_lines() -> range:
    """The lines of `policy_update`'s micro-batch loop."""
    src, start = inspect.getsourcelines(policy_update)
    first = next(i for i, line in enumerate(src) if "for i in range(dist.max(len(micro)))" in line)
    last = next(i for i, line in enumerate(src) if "finite = dist.all(" in line)
    return range(start + first, start + last)


@pytest.fixture
def host_reads(monkeypatch) -> Counter:
    """Host reads made by agent-r1's code (the read's caller) inside the micro-batch loop, by caller."""
    lines, reads = loop_lines(), Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            caller = frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code is policy_update.__code__ and frame.f_lineno in lines:
                    if "agent_r1" in caller.f_code.co_filename:
                        reads[f"{_name} in {caller.f_code.co_name}:{caller.f_lineno}"] += 1
                    break
                frame = frame.f_back
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    return reads


@pytest.mark.parametrize("overrides", [[], ["algo.estimator=ppo", "algo.kl_coef=0.1"]])
def test_no_host_read_between_the_micro_batches_of_a_mini_batch(tmp_path, host_reads, overrides):
    model = make_tiny_llama(64, hidden=32)
    cfg = toy_config(tmp_path, *overrides, "optim.micro_batch_tokens=64")
    critic = Critic(model, "head") if cfg.algo.estimator == "ppo" else None
    params = [p for m in (model, critic) if m is not None for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    data = rows(24)
    for r in data:
        r.ref_logp, r.old_values, r.returns = torch.zeros(8), torch.zeros(8), torch.ones(8)
    out = policy_update(model, critic, data, optimizer, scheduler, params, cfg, 0)
    assert out["updates"] == 1 and out["train_tokens"] > 64  # several micro-batches ran
    assert host_reads == Counter()
    assert out["entropy"] > 0 and out["logprob_drift_max"] >= out["logprob_drift_mean"] >= 0


def test_a_non_finite_loss_skips_the_step_and_changes_no_weight(tmp_path):
    model = make_tiny_llama(64, hidden=32)
    cfg = toy_config(tmp_path, "optim.micro_batch_tokens=64")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    data = rows(24)
    data[-1].adv[:] = float("nan")  # one micro-batch's loss is NaN: the whole step is dropped
    before = [p.detach().clone() for p in model.parameters()]
    out = policy_update(model, None, data, optimizer, scheduler, list(model.parameters()), cfg, 0)
    assert out["updates"] == 0 and out["skipped_nonfinite"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
