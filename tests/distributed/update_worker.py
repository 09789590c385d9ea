"""One optimizer step of `policy_update` on a fixed batch, in one process or as one torchrun rank
under FSDP2; writes the updated weights (and metrics) to OUT. Run by test_fsdp.py:

    python -m tests.distributed.update_worker OUT ESTIMATOR            # one process, no FSDP
    torchrun --nproc_per_node 2 -m tests.distributed.update_worker OUT ESTIMATOR
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file

from agent_r1.config import load_config
from agent_r1.distributed import fsdp
from agent_r1.distributed.group import end_rank, init_distributed
from agent_r1.trainer.common import adamw
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.critic import Critic
from agent_r1.trainer.rows import row_logprobs
from agent_r1.trainer.update import policy_update
from tests.distributed.rows import synthetic_rows
from tests.trainer.conftest import tiny_model


def main(out: str, estimator: str) -> None:
    dist = init_distributed("cpu")
    ppo = estimator.startswith("ppo")  # ppo: a value head; ppo-separate: a critic of its own
    overrides = ["optim.micro_batch_tokens=160", "optim.lr=1e-2", f"algo.estimator={'ppo' if ppo else estimator}"]
    if ppo:
        overrides += [
            "algo.mini_batches=2",
            "algo.kl_coef=0.1",
            f"algo.critic={'separate' if '-' in estimator else 'head'}",
        ]
    cfg = load_config(TrainConfig, None, overrides)
    policy = tiny_model(seed=0)
    rows = synthetic_rows(critic=ppo, kl=cfg.algo.kl_coef > 0)
    for row, logp in zip(rows, row_logprobs(policy, rows, 256, 1.0), strict=True):  # the old policy: the start
        row.old_logp = logp * row.mask
    critic = Critic(policy, cfg.algo.critic) if ppo else None
    if dist.world > 1:
        fsdp.shard(policy)
        if critic is not None:
            fsdp.shard(critic)
    modules = {"policy": policy} | ({"critic": critic} if critic else {})
    params = [p for m in modules.values() for p in m.parameters()]
    params = list({id(p): p for p in params}.values())
    optimizer = adamw(params, cfg.optim.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = policy_update(policy, critic, rows, optimizer, scheduler, params, cfg, step=0, dist=dist)
    state = {}
    for name, m in modules.items():
        full = dict(fsdp.iter_full_weights(m)) if dist.world > 1 else m.state_dict()
        state |= {f"{name}.{k}": v.detach().clone().contiguous() for k, v in full.items()}
    if dist.main:
        state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}  # tied to embed_tokens
        save_file(state, f"{out}/weights.safetensors")
        with open(f"{out}/metrics.json", "w") as f:
            json.dump(metrics, f)
    dist.close()
    assert not torch.distributed.is_initialized(), "Dist.close left the process group it started"
    if dist.world > 1:
        end_rank(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
