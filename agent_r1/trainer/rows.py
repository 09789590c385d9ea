"""A step's trajectories as training rows: merged once, with an index from rows back to steps.

`build_rows` turns each trajectory's merged rows (`rollout.merge`, merged once by the trainer) into
the tensor `Row`s the update trains on; the trajectory records show the same merged rows. Step-level
quantities (rewards, advantages, KL) move between the two through `RowIndex`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agent_r1.algos.advantages import token_advantages
from agent_r1.algos.losses import kl_penalty
from agent_r1.algos.off_policy import drift_metrics, truncated_is_weights
from agent_r1.distributed.group import SINGLE, Dist
from agent_r1.models.grammar import Grammars
from agent_r1.observe.records import trajectory_records, write_records
from agent_r1.trainer.batching import Row, forward_rows, image_row_key, token_logprobs
from agent_r1.types import TrainSequence, Trajectory

logger = logging.getLogger(__name__)


@dataclass
class RowIndex:
    """Where each trajectory's steps live among the rows (a trajectory may span several rows)."""

    row_owner: list[int]  # per row: index of its trajectory
    step_index: list[torch.Tensor]  # per row [T]: step that sampled the token, -1 elsewhere
    step_tokens: list[torch.Tensor]  # per trajectory [K_i]: sampled tokens of each step


def build_rows(
    trajs: list[Trajectory],
    sequences: list[list[TrainSequence]],
    image_token: int | None = None,
    grammars: Callable[[], Grammars] | None = None,
) -> tuple[list[Row], RowIndex]:
    """Rows of every trajectory from `sequences[i]`, its merged rows, with one segment id per step
    response (GSPO's sequences, the seq-mean aggregations); `image_token` is a VLM's placeholder id;
    `grammars` gives the compiled grammars of the policy's tokenizer, for steps sampled under one."""
    rows, owners, step_idx = [], [], []
    seg_base = 0
    for ti, (t, seqs) in enumerate(zip(trajs, sequences, strict=True)):
        for seq in seqs:
            sidx = torch.tensor(seq.step_index)
            rows.append(
                Row(
                    input_ids=torch.tensor(seq.input_ids),
                    mask=torch.tensor(seq.loss_mask, dtype=torch.float32),
                    old_logp=torch.tensor(seq.logprobs, dtype=torch.float32),
                    adv=torch.zeros(len(seq.input_ids)),
                    seg=torch.where(sidx >= 0, seg_base + sidx, -1),
                    images=seq.images,
                    key=image_row_key(seq.input_ids, seq.images, image_token),
                    version=torch.tensor(seq.versions) if seq.versions else None,
                )
            )
            if seq.grammars and grammars is not None:
                _grammar_masks(rows[-1], sidx, seq.grammars, grammars())
            owners.append(ti)
            step_idx.append(sidx)
        seg_base += len(t.steps)
    step_tokens = [torch.tensor([len(s.response_ids) for s in t.steps], dtype=torch.float32) for t in trajs]
    return rows, RowIndex(owners, step_idx, step_tokens)


def _grammar_masks(row: Row, sidx: torch.Tensor, by_step: dict[int, str], grammars: Grammars) -> None:
    """The bitmask before each token its step's grammar constrained, by replaying the grammar over the step's
    sampled ids (models/grammar.py says why this is the engine's mask). A step whose ids the grammar refuses
    (sampled by an engine with another vocabulary, say) cannot have its distribution rebuilt: it stays in the
    row as context and is not trained."""
    positions, masks = [], []
    for k, grammar in sorted(by_step.items()):
        where = (sidx == k).nonzero().squeeze(-1)  # [R] the step's sampled tokens
        try:
            masks.append(grammars.masks(grammar, row.input_ids[where].tolist()))
            positions.append(where)
        except ValueError as exc:
            logger.warning("step %d is not trained: %s", k, exc)
            row.mask[where] = 0.0
    if positions:
        row.constrained, row.allowed = torch.cat(positions), torch.cat(masks)


@torch.no_grad()
def row_logprobs(
    model: torch.nn.Module, rows: list[Row], micro_batch_tokens: int, temperature: float, dist: Dist = SINGLE
) -> list[torch.Tensor]:
    """Each row's log-probs [T] on the CPU, batched like the update (shared prefixes once); under
    torchrun split between the ranks (`forward_rows`)."""
    return forward_rows(model, rows, micro_batch_tokens, lambda mb: token_logprobs(model, mb, temperature)[0], dist)


def fill_ref_logprobs(
    ref: Callable, rows: list[Row], micro_batch_tokens: int, temperature: float, dist: Dist = SINGLE
) -> None:
    """Reference-policy log-probs of the rows."""
    with ref() as model:
        for row, logp in zip(rows, row_logprobs(model, rows, micro_batch_tokens, temperature, dist), strict=True):
            row.ref_logp = logp


def recompute_old_logprobs(
    policy: torch.nn.Module,
    rows: list[Row],
    micro_batch_tokens: int,
    temperature: float,
    dist: Dist = SINGLE,
    version: int | None = None,
) -> dict[str, float]:
    """The trainer's own log-probs of the sampled tokens under the current weights become the ratio's old
    (proximal) log-probs; the engine's move to `row.rollout_logp` (algos/off_policy.py says why).
    Returns the drift between the two (logprob_drift_mean / _max): with `version` (async RL), only over
    the steps these very weights sampled, so it stays the consistency check and not a staleness measure."""
    for row, logp in zip(rows, row_logprobs(policy, rows, micro_batch_tokens, temperature, dist), strict=True):
        row.rollout_logp, row.old_logp = row.old_logp, logp * row.mask
    masks = [r.mask if version is None or r.version is None else r.mask * (r.version == version) for r in rows]
    return drift_metrics([r.old_logp for r in rows], [r.rollout_logp for r in rows], masks)


def apply_tis(rows: list[Row], cap: float) -> dict[str, float]:
    """Scale each sampled token's advantage by its truncated importance weight; returns the weights'
    mean and the share of tokens at the cap."""
    weights = []
    for row in rows:
        w = truncated_is_weights(row.old_logp, row.rollout_logp, row.mask, cap)  # [T]
        row.adv = row.adv * w
        weights.append(w[row.mask > 0])
    w = torch.cat(weights) if weights else torch.zeros(0)
    if not w.numel():
        return {}
    return {"tis_weight_mean": float(w.mean()), "tis_clip_frac": float((w >= cap * (1 - 1e-6)).float().mean())}


def step_kl(rows: list[Row], where: RowIndex, estimator: str) -> list[torch.Tensor]:
    """Per trajectory [K_i]: the summed per-token KL estimate (rollout vs reference) of each step."""
    out = [torch.zeros(len(t)) for t in where.step_tokens]
    for row, ti, sidx in zip(rows, where.row_owner, where.step_index, strict=True):
        kl = kl_penalty(row.old_logp, row.ref_logp, estimator) * row.mask  # [T]
        sampled = sidx >= 0
        out[ti].index_add_(0, sidx[sampled], kl[sampled].float())
    return out


def set_step_advantages(rows: list[Row], where: RowIndex, step_adv: list[torch.Tensor]) -> None:
    """Broadcast per-step advantages [K_i] onto each row's sampled tokens."""
    for row, ti, sidx in zip(rows, where.row_owner, where.step_index, strict=True):
        row.adv = token_advantages([step_adv[ti]], sidx, torch.zeros_like(sidx)).float()


def write_step_records(
    path, trajs: list[Trajectory], sequences, kept: list[int], rows: list[Row], where: RowIndex, tokenizer, step: int
) -> None:
    """The step's trajectory records, each trained row with its advantages (and reference log-probs);
    episodes left out of the update (errors) are recorded too, without advantages."""
    advs: list[list | None] = [None] * len(trajs)
    refs: list[list | None] = [None] * len(trajs)
    for i in kept:
        advs[i], refs[i] = [], []
    for row, ti in zip(rows, where.row_owner, strict=True):
        advs[kept[ti]].append(row.adv)
        refs[kept[ti]].append(row.ref_logp)
    records = trajectory_records(trajs, tokenizer, step=step, sequences=sequences, advantages=advs, ref_logprobs=refs)
    write_records(path, records)
