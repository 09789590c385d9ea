"""FSDP2 on 2 gloo processes: one update equals the single-process update on the same batch."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.distributed.conftest import launch
from tests.distributed.rows import synthetic_rows
from tests.trainer.conftest import tiny_model


@pytest.mark.parametrize("estimator", ["grpo", "ppo", "ppo-separate"])
def test_two_fsdp_processes_take_the_single_process_step(tmp_path, estimator):
    """GRPO: one optimizer step; PPO: a value head (or a critic model of its own, sharded too), a KL term
    and two mini-batches (two steps). The 2-rank job splits every mini-batch between the ranks."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    launch(["-m", "tests.distributed.update_worker", str(one), estimator], nproc=1)
    launch(["-m", "tests.distributed.update_worker", str(two), estimator], nproc=2)
    a, b = load_file(one / "weights.safetensors"), load_file(two / "weights.safetensors")
    start = {f"policy.{k}": v for k, v in tiny_model(seed=0).state_dict().items()}
    assert a.keys() == b.keys() and len(a) > 10
    ppo = estimator.startswith("ppo")
    assert any(k.startswith("critic.head") for k in a) == ppo
    assert any(k.startswith("critic.backbone") for k in a) == (estimator == "ppo-separate")
    for k in a:
        scale = a[k].norm().clamp(min=1e-12)
        assert float((a[k] - b[k]).norm() / scale) <= 1e-5, k
        if k in start:  # the step really moved the weights: the comparison is not of two untouched models
            assert float((a[k] - start[k]).norm() / scale) > 1e-3, k
    ma, mb = json.loads((one / "metrics.json").read_text()), json.loads((two / "metrics.json").read_text())
    assert ma["updates"] == mb["updates"] == (2 if ppo else 1)
    # every row trained once, on one rank, its shared prompt computed once per micro-batch on either side
    rows = synthetic_rows(critic=ppo, kl=ppo)
    assert ma["train_tokens"] <= mb["train_tokens"] < sum(len(r.input_ids) for r in rows)
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5)
