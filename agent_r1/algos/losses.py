"""Policy, value and KL losses on flat token tensors.

Every per-token input is [N] over the tokens of a (packed) micro-batch: `logp` (current policy, with
gradient), `old_logp` (rollout / behaviour policy), `adv`, `mask` (float, 1 on trainable sampled
tokens) and `seq_ids` (long, which sequence each token belongs to; any value where mask is 0). Losses
return a scalar to minimise plus a dict of float metrics measured over the masked tokens.

Aggregation (`aggregate`) turns per-token losses into the scalar. Pass the totals of the whole
mini-batch as `n_tokens` / `n_seqs` so that summing the losses of its micro-batches (gradient
accumulation) equals the loss of the mini-batch in one piece.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask > 0, else 0 (a `where`, not a product, so garbage off the mask never leaks nan)."""
    return torch.where(mask > 0, x, torch.zeros_like(x))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Metric helper: masked mean as a detached 0-d tensor (0 when nothing is masked). Metrics stay on the
    device: the trainer reads them once per update, not with a host sync at every micro-batch."""
    return ((_masked(x, mask) * mask).sum() / mask.sum().clamp(min=1)).detach()


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Metric helper: the largest masked entry of a non-negative `x` as a detached 0-d tensor (0 when none)."""
    return (x.detach() * (mask > 0)).max() if x.numel() else x.new_zeros(())


def _seq_sums(x: Tensor, mask: Tensor, seq_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sequence masked sums of x and of the mask: ([S], [S]) over the distinct masked seq ids."""
    inverse = _seq_index(mask, seq_ids)  # [N]
    n_seq = int(inverse.max()) + 1 if inverse.numel() else 0
    m = mask.to(x.dtype)  # [N]
    sums = x.new_zeros(n_seq).index_add(0, inverse, _masked(x, m) * m)  # [S]
    counts = x.new_zeros(n_seq).index_add(0, inverse, m)  # [S]
    return sums, counts


def _seq_index(mask: Tensor, seq_ids: Tensor) -> Tensor:
    """Compact sequence index 0..S-1 of every token [N]; unmasked tokens are put with id 0's sequence
    (they carry no weight there), so their ids may be anything."""
    ids = torch.where(mask > 0, seq_ids.long(), torch.zeros_like(seq_ids, dtype=torch.long))  # [N]
    return torch.unique(ids, return_inverse=True)[1]


def aggregate(
    loss: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    mode: AggMode,
    n_tokens: float | None = None,
    n_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Reduce per-token losses [N] to a scalar.

    * "token-mean": sum(loss * mask) / n_tokens (DAPO, arXiv 2503.14476: every token weighs the same).
    * "seq-mean-token-mean": sum over sequences of (the sequence's masked token mean) / n_seqs
      (GRPO as in DeepSeekMath, arXiv 2402.03300; GSPO).
    * "seq-mean-token-sum-norm": sum over sequences of (masked token sum / norm_len) / n_seqs
      (Dr.GRPO, arXiv 2503.20783: a constant length normaliser removes the length bias).

    `n_tokens` defaults to the number of masked tokens and `n_seqs` to the number of sequences with at
    least one masked token, both local; the trainer passes mini-batch totals so that gradient
    accumulation over micro-batches gives the full-batch loss. Note that the seq-mean modes are only
    accumulation-exact when no sequence is split across micro-batches.
    """
    if mode == "token-mean":
        n = float(mask.sum()) if n_tokens is None else float(n_tokens)
        return (_masked(loss, mask) * mask).sum() / max(n, 1.0)
    if mode not in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        raise ValueError(
            f"unknown aggregation {mode!r}; use token-mean, seq-mean-token-mean or seq-mean-token-sum-norm"
        )
    sums, counts = _seq_sums(loss, mask, seq_ids)  # [S], [S]
    present = counts > 0  # [S]
    n = float(present.sum()) if n_seqs is None else float(n_seqs)
    if mode == "seq-mean-token-mean":
        per_seq = torch.where(present, sums / counts.clamp(min=1e-12), torch.zeros_like(sums))  # [S]
    else:
        if norm_len is None or norm_len <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_len > 0 (e.g. the max response length)")
        per_seq = sums / norm_len  # [S]
    return per_seq.sum() / max(n, 1.0)


def _clipped_pg(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate loss: (loss [N], clipped [N] bool, dual_clipped [N] bool)."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    unclipped = -adv * ratio  # [N]
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N]
    loss = torch.maximum(unclipped, clipped)  # [N] = -min(r A, clip(r) A)
    is_clipped = clipped > unclipped  # [N] the clip term is the active (pessimistic) one
    is_dual = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip  # [N] only binds where A < 0
        is_dual = (adv < 0) & (loss > cap)
        loss = torch.where(is_dual, cap, loss)
    return loss, is_clipped, is_dual


def _pg_metrics(
    log_ratio: Tensor, ratio: Tensor, mask: Tensor, is_clipped: Tensor, is_dual: Tensor
) -> dict[str, Tensor]:
    with torch.no_grad():
        # k3 estimate of KL(pi_old || pi) on tokens sampled from pi_old: (r - 1) - log r >= 0
        k3 = ratio - 1.0 - log_ratio
        return {
            "clip_frac": _masked_mean(is_clipped.to(mask.dtype), mask),
            "dual_clip_frac": _masked_mean(is_dual.to(mask.dtype), mask),
            "approx_kl": _masked_mean(k3, mask),
            "ratio_max": _masked_max(ratio, mask),
        }


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: AggMode = "token-mean",
    n_tokens: float | None = None,
    n_seqs: float | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), token level.

    Per token, r = exp(logp - old_logp) and loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A).
    The asymmetric range is DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476; e.g. 0.2 / 0.28).
    `dual_clip = c > 1` is dual-clip PPO (Ye et al. 2020, arXiv 1912.09729): where A < 0 the loss is
    also capped at -c A, so a huge ratio on a bad token cannot blow up the update.

    Metrics over masked tokens: clip_frac (the clipped term is active), dual_clip_frac, approx_kl (k3
    estimate of KL(pi_old || pi): mean of (r - 1) - log r), ratio_max.
    """
    log_ratio = _masked(logp - old_logp, mask)  # [N] 0 off the mask, so exp never overflows there
    ratio = torch.exp(log_ratio)  # [N]
    per_token, is_clipped, is_dual = _clipped_pg(ratio, adv, clip_low, clip_high, dual_clip)  # [N]
    loss = aggregate(per_token, mask, seq_ids, agg, n_tokens, n_seqs, norm_len)
    return loss, _pg_metrics(log_ratio, ratio, mask, is_clipped, is_dual)


def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    agg: AggMode = "seq-mean-token-mean",
    n_tokens: float | None = None,
    n_seqs: float | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071), GSPO-token form.

    The importance ratio is per sequence: s_i = exp(mean over the sequence's masked tokens of
    (logp - old_logp)), i.e. the length-normalised sequence likelihood ratio. The GSPO-token form
    s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t)) has the value s_i on every token but lets each token
    carry its own advantage; with a per-sequence advantage its gradient equals sequence-level GSPO.
    s_{i,t} is clipped to [1 - clip_low, 1 + clip_high] exactly like the PPO ratio.

    Because s_i is a geometric mean of token ratios it stays very close to 1, so the clip range is tiny:
    the defaults 3e-4 / 4e-4 are the paper's. Default aggregation is the paper's seq-mean-token-mean.
    Dual clip and the metrics work as in `ppo_policy_loss` (clip_frac counts tokens, approx_kl is the
    token-level k3).
    """
    token_log_ratio = _masked(logp - old_logp, mask)  # [N]
    sums, counts = _seq_sums(token_log_ratio.detach(), mask, seq_ids)  # [S]
    seq_log_ratio = sums / counts.clamp(min=1e-12)  # [S] mean log-ratio of each sequence
    inverse = _seq_index(mask, seq_ids)  # [N] same compaction as _seq_sums
    # log s_{i,t} = sg(log s_i) + logp_t - sg(logp_t): value log s_i, gradient d logp_t
    log_s = _masked(seq_log_ratio[inverse] + logp - logp.detach(), mask)  # [N]
    s = torch.exp(log_s)  # [N]
    per_token, is_clipped, is_dual = _clipped_pg(s, adv, clip_low, clip_high, dual_clip)  # [N]
    loss = aggregate(per_token, mask, seq_ids, agg, n_tokens, n_seqs, norm_len)
    metrics = _pg_metrics(token_log_ratio, torch.exp(token_log_ratio), mask, is_clipped, is_dual)
    metrics["seq_ratio_max"] = _masked_max(s, mask)
    return loss, metrics


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: Literal["k1", "k2", "k3"]) -> Tensor:
    """Per-token estimators of KL(pi || pi_ref) on tokens sampled from pi (J. Schulman, "Approximating
    KL Divergence", 2020, http://joschu.net/blog/kl-approx.html). With d = logp - ref_logp:

    * k1 = d (unbiased, high variance, can be negative; the usual reward penalty),
    * k2 = d^2 / 2 (biased, low variance; its gradient is the gradient of the true KL),
    * k3 = exp(-d) + d - 1 = exp(ref - logp) - (ref - logp) - 1 (unbiased, always >= 0; GRPO's loss KL).
    Returns [N] (same shape as the inputs); mask and aggregate it like any other per-token loss.
    """
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    clip: float | None = 0.2,
    agg: AggMode = "token-mean",
    n_tokens: float | None = None,
    n_seqs: float | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss of PPO2 (OpenAI baselines; verl), per token:

    0.5 * max((v - R)^2, (v_old + clamp(v - v_old, -clip, clip) - R)^2). `clip=None` gives the plain
    0.5 * (v - R)^2. Metric vf_clip_frac: fraction of masked tokens where the clipped term is larger.
    """
    unclipped = (values - returns) ** 2  # [N]
    if clip is None:
        per_token, is_clipped = 0.5 * unclipped, torch.zeros_like(mask, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)  # [N]
        clipped = (v_clip - returns) ** 2  # [N]
        per_token, is_clipped = 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
    loss = aggregate(per_token, mask, seq_ids, agg, n_tokens, n_seqs, norm_len)
    return loss, {"vf_clip_frac": _masked_mean(is_clipped.to(mask.dtype), mask)}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...].

    H = -sum_v p_v log p_v with log p = log_softmax(z) = z - logsumexp(z), which subtracts the max
    logit first, so it stays exact for huge logits (the textbook logsumexp(z) - sum p z loses every
    digit of H in fp32 once |z| ~ 1e4). Logits must be finite (mask with a large negative number
    rather than -inf).
    """
    logp = torch.log_softmax(logits, dim=-1)  # [..., V]
    return -(logp.exp() * logp).sum(-1)
