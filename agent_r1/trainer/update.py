"""The policy (and value) update of one RL step: epochs x mini-batches x packed micro-batches.

Each mini-batch is one optimizer step. Loss normalisers (token and sequence counts) are mini-batch
totals, so summing the micro-batches' losses (gradient accumulation) equals the mini-batch loss in one
piece. A non-finite loss or gradient skips the optimizer step: a NaN never reaches the weights.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from agent_r1.algos.losses import aggregate, gspo_policy_loss, kl_penalty, ppo_policy_loss, value_loss
from agent_r1.distributed.group import SINGLE, Dist
from agent_r1.models.precision import model_device
from agent_r1.trainer.batching import Row, pack, token_logprobs
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.critic import Critic, value_mask
from agent_r1.utils.malloc import release_memory, trim_heap


def policy_update(
    policy: torch.nn.Module,
    critic: Critic | None,
    rows: list[Row],
    optimizer: torch.optim.Optimizer,
    scheduler,
    params: list[torch.nn.Parameter],
    cfg: TrainConfig,
    step: int,
    dist: Dist = SINGLE,
) -> dict[str, float]:
    """Train on `rows`; returns the mean of every loss metric, grad norm, drift and counts.

    Under torchrun every rank holds every row; each mini-batch is split between the ranks by tokens,
    its normalisers are all-reduced, and every rank runs as many micro-batches as the busiest one (a
    rank short of work repeats one with weight 0), so the collectives inside FSDP2 always pair up."""
    a, o = cfg.algo, cfg.optim
    stats: dict[str, list[float]] = {}
    skipped = train_tokens = row_tokens = updates = 0
    if not rows:
        return {"train_tokens": 0, "skipped_nonfinite": 0, "updates": 0}
    release_memory()  # what the reference pass freed (its weights, with reference_on_disk) goes back first
    policy.train()
    device = model_device(policy)
    norm_len = float(cfg.rollout.max_new_tokens)  # Dr.GRPO's constant: a "sequence" is one step's response
    policy_loss_fn = gspo_policy_loss if a.policy_loss == "gspo" else ppo_policy_loss
    clip_low, clip_high = a.clip_range()
    drift: list[torch.Tensor] = []  # |trainer - rollout| log-prob of sampled tokens, before any update
    for epoch in range(a.epochs):
        shuffle = torch.Generator(device="cpu").manual_seed(cfg.seed * 7919 + step * 31 + epoch)
        order = torch.randperm(len(rows), generator=shuffle, device="cpu")  # row indices: CPU on any device
        for mini in order.chunk(a.mini_batches):
            batch = [rows[i] for i in mini.tolist()]
            mine = dist.shard(batch, cost=lambda r: len(r.input_ids))
            n_tokens, n_seqs = dist.sum(
                sum(float(r.mask.sum()) for r in mine), sum(len(r.seg[r.mask.bool()].unique()) for r in mine)
            )  # the whole mini-batch's
            if n_tokens == 0:
                continue
            agg = {"mode": a.loss_agg, "n_tokens": n_tokens, "n_seqs": n_seqs, "norm_len": norm_len}
            optimizer.zero_grad(set_to_none=True)
            nonfinite = torch.zeros((), dtype=torch.bool, device=device)  # read once, after the micro-batches
            micro = pack(mine, o.micro_batch_tokens, device=device)
            filler = micro[0] if micro else pack(batch[:1], o.micro_batch_tokens, device=device)[0]
            for i in range(dist.max(len(micro))):
                mb, weight = (micro[i], 1.0) if i < len(micro) else (filler, 0.0)
                logp, entropy, hidden = token_logprobs(
                    policy, mb, cfg.rollout.temperature, entropy=True, entropy_grad=a.entropy_coef > 0,
                    hidden=critic is not None and critic.shared,
                )  # fmt: skip
                loss, m = policy_loss_fn(
                    logp, mb.old_logp, mb.adv, mb.mask, mb.seg, clip_low=clip_low, clip_high=clip_high,
                    dual_clip=a.dual_clip, agg=a.loss_agg, n_tokens=n_tokens, n_seqs=n_seqs, norm_len=norm_len,
                )  # fmt: skip
                if a.kl_coef > 0 and a.kl_mode == "loss":
                    kl_tok = kl_penalty(logp, mb.ref_logp, a.kl_estimator)  # [L]
                    loss = loss + a.kl_coef * aggregate(kl_tok, mb.mask, mb.seg, **agg)
                    m["kl"] = (kl_tok.detach() * mb.mask).sum() / mb.mask.sum().clamp(min=1)
                if a.entropy_coef > 0:
                    loss = loss - a.entropy_coef * aggregate(entropy, mb.mask, mb.seg, **agg)
                if critic is not None:  # value targets: every sampled token, or each step's first one
                    vl, vm = value_loss(
                        critic(mb, hidden), mb.old_values, mb.returns, value_mask(mb, a.gae_level), mb.seg,
                        clip=a.value_clip, agg="token-mean", n_tokens=n_tokens if a.gae_level == "token" else n_seqs,
                    )  # fmt: skip
                    loss = loss + a.vf_coef * vl
                    m |= vm | {"value_loss": vl.detach()}
                if weight == 0.0:  # a filler: its backward only keeps FSDP's collectives in step
                    (loss * 0.0).backward()
                    continue
                if updates == 0:  # weights are still the rollout's: any difference is drift, not learning
                    drift.append(_drift(logp.detach(), mb.old_logp, mb.mask))
                # a non-finite loss still runs its backward (other ranks' reduce-scatters need this rank's);
                # its NaN gradients are dropped with the step, which every rank skips. Checked once, below:
                # a check here would wait for the device at every micro-batch
                nonfinite |= ~torch.isfinite(loss.detach())
                loss.backward()
                trim_heap()  # the micro-batch's freed activations back to the OS before the next one
                train_tokens += mb.num_tokens
                row_tokens += len(mb.input_ids)
                m["entropy"] = (entropy.detach() * mb.mask).sum() / mb.mask.sum().clamp(min=1)
                for k, v in m.items():  # 0-d tensors on the device, read after the update
                    stats.setdefault(k, []).append(v)
            finite = dist.all(not bool(nonfinite))
            grad_norm = clip_grad_norm(params, o.grad_clip) if finite else torch.tensor(math.nan)
            if not finite or not torch.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)  # never apply a NaN/inf update
                skipped += 1
                continue
            optimizer.step()
            scheduler.step()
            updates += 1
            stats.setdefault("grad_norm", []).append(float(grad_norm))
    policy.eval()
    optimizer.zero_grad(set_to_none=True)  # gradients are not kept through the rollout: 4 B/param for vLLM
    stats = {k: [float(x) for x in v] for k, v in stats.items()}  # the device is idle now: cheap reads
    stats, drift, (train_tokens, row_tokens) = _gathered(
        dist, stats, [d.cpu() for d in drift], (train_tokens, row_tokens)
    )
    out = {k: sum(v) / len(v) for k, v in stats.items() if v}
    if drift and (d := torch.stack(drift))[:, 1].sum() > 0:  # [n, 3]: sum, count, max per micro-batch
        out |= {"logprob_drift_mean": float(d[:, 0].sum() / d[:, 1].sum()), "logprob_drift_max": float(d[:, 2].max())}
    # computed_share: the tokens the update computed over the tokens in its rows (each shared prefix once)
    share = {"computed_share": train_tokens / row_tokens} if row_tokens else {}
    return out | share | {"train_tokens": train_tokens, "skipped_nonfinite": skipped, "updates": updates}


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients to a global norm of at most `max_norm`; returns the norm before clipping.
    Under FSDP2 the gradients are shards (DTensors): their norm is reduced over every rank first."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _drift(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|logp - old_logp| over the sampled tokens of a micro-batch as [sum, count, max], on the device (a
    boolean-mask selection would wait for it)."""
    d = (logp - old_logp).abs() * mask  # [L]
    return torch.stack([d.sum(), mask.sum(), d.max() if d.numel() else d.new_zeros(())])


def _gathered(dist: Dist, stats: dict, drift: list, tokens: tuple[int, int]) -> tuple[dict, list, tuple[int, int]]:
    """Every rank's metrics, drift and token counts (computed, in rows) together (rank 0 logs them)."""
    if dist.world == 1:
        return stats, drift, tokens
    parts = dist.gather((stats, drift, tokens))
    merged: dict[str, list[float]] = {}
    for rank_stats, _, _ in parts:
        for k, v in rank_stats.items():
            if k != "grad_norm":  # the global norm: the same on every rank
                merged.setdefault(k, []).extend(v)
    merged["grad_norm"] = stats.get("grad_norm", [])
    counts = (sum(n[0] for _, _, n in parts), sum(n[1] for _, _, n in parts))
    return merged, [t for _, d, _ in parts for t in d], counts
