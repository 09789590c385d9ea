"""Off-policy correction between the rollout engine and the trainer.

vLLM's kernels (and bf16) are not the trainer's, so the probability a token had when it was sampled,
p_rollout, differs from the trainer's p_old for the same weights; a large learning-rate-free gap that
PPO's ratio p / p_rollout would silently absorb as if it were learning. The fix used by verl and
described by Yao et al. 2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", fengyao.notion.site/off-policy-rl): recompute p_old with the trainer, use it in the PPO
ratio, and weight each token's policy-gradient term by the truncated importance ratio
w = min(p_old / p_rollout, C) (truncated IS, Ionides 2008; IMPALA's rho-bar, Espeholt et al. 2018,
arXiv 1802.01561), which corrects for having sampled from p_rollout while bounding the variance.

w > 0 and carries no gradient, so weighting the PPO term by w equals scaling the token's advantage by
w (the clip and the dual clip act on the ratio alone): `trainer/rl.py` applies it to the advantages.
"""

from __future__ import annotations

import math

import torch


def truncated_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """w = min(exp(old_logp - rollout_logp), cap) on sampled tokens, 1 elsewhere: all [T]."""
    log_w = torch.where(mask > 0, old_logp - rollout_logp, torch.zeros_like(old_logp))  # [T]
    return torch.exp(log_w.clamp(max=math.log(cap)))


def drift_metrics(old_logp: list[torch.Tensor], rollout_logp: list[torch.Tensor], masks: list[torch.Tensor]):
    """|trainer - rollout| log-prob of every sampled token: its mean and max (the consistency check)."""
    parts = [(o - r)[m > 0].abs() for o, r, m in zip(old_logp, rollout_logp, masks, strict=True)]
    d = torch.cat(parts) if parts else torch.zeros(0)  # no rows: every group of the step was left out
    if not d.numel():
        return {}
    return {"logprob_drift_mean": float(d.mean()), "logprob_drift_max": float(d.max())}
