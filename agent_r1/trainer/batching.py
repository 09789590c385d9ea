"""Pack training rows into micro-batches under a token budget: no padding, no wasted compute.

Rows of one micro-batch are concatenated into a single sequence whose position ids restart at 0 at
every row. transformers turns such position ids into a block-diagonal causal mask (its "packed
sequence" detection), so rows never attend to each other, and the model runs over real tokens only.
Bins are filled first-fit-decreasing, which comes within a few % of the budget for typical batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One training row with every per-token tensor the losses need; all [T]."""

    input_ids: torch.Tensor  # long
    mask: torch.Tensor  # float, 1 on sampled tokens
    old_logp: torch.Tensor  # rollout log-probs (0 off the mask)
    adv: torch.Tensor  # advantages (0 off the mask)
    seg: torch.Tensor  # long, segment id of each token (one per step response) for seq aggregation / GSPO
    ref_logp: torch.Tensor | None = None  # reference-policy log-probs when KL is on
    old_values: torch.Tensor | None = None  # critic values at rollout time (PPO)
    returns: torch.Tensor | None = None  # critic targets (PPO)


@dataclass
class MicroBatch:
    """Packed rows: one [L] sequence per field, plus position ids that restart per row."""

    input_ids: torch.Tensor  # [L]
    position_ids: torch.Tensor  # [L]
    mask: torch.Tensor  # [L]
    old_logp: torch.Tensor  # [L]
    adv: torch.Tensor  # [L]
    seg: torch.Tensor  # [L]
    ref_logp: torch.Tensor | None
    old_values: torch.Tensor | None
    returns: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pack(rows: list[Row], max_tokens: int) -> list[MicroBatch]:
    """First-fit-decreasing packing of rows into micro-batches of at most `max_tokens` tokens
    (a row longer than the budget gets a micro-batch of its own)."""
    bins: list[list[Row]] = []
    room: list[int] = []
    for row in sorted(rows, key=lambda r: -len(r.input_ids)):
        n = len(row.input_ids)
        if n and float(row.mask[0]) != 0.0:
            raise ValueError("a training row must start with a prompt token (its first token has no prediction)")
        for i, free in enumerate(room):
            if n <= free:
                bins[i].append(row)
                room[i] -= n
                break
        else:
            bins.append([row])
            room.append(max_tokens - n)
    return [_concat(b) for b in bins]


def _concat(rows: list[Row]) -> MicroBatch:
    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(r, name) for r in rows]
        return None if parts[0] is None else torch.cat(parts)

    positions = torch.cat([torch.arange(len(r.input_ids)) for r in rows])
    return MicroBatch(
        input_ids=cat("input_ids"),
        position_ids=positions,
        mask=cat("mask"),
        old_logp=cat("old_logp"),
        adv=cat("adv"),
        seg=cat("seg"),
        ref_logp=cat("ref_logp"),
        old_values=cat("old_values"),
        returns=cat("returns"),
    )


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0, *, entropy: bool = False, hidden: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-prob of every masked token under `model` from one forward pass over the packed row.

    Logits are computed only at positions that predict a masked token (`logits_to_keep` as indices),
    which skips the vocabulary projection for prompt and tool tokens.
    Returns logp [L] (0 off the mask), entropy [L] (0 off the mask) or None, last hidden state
    [L, H] or None.
    """
    targets = mb.mask.nonzero().squeeze(-1)  # [M] positions of sampled tokens
    out = model(
        input_ids=mb.input_ids[None],
        position_ids=mb.position_ids[None],
        logits_to_keep=targets - 1,
        output_hidden_states=hidden,
        use_cache=False,  # a cache would switch off transformers' packed-sequence (block-diagonal) mask
    )
    logits = out.logits[0].float() / temperature  # [M, V]
    lse = torch.logsumexp(logits, dim=-1)  # [M]
    picked = logits.gather(-1, mb.input_ids[targets, None]).squeeze(-1) - lse  # [M]
    logp = torch.zeros(mb.num_tokens, dtype=picked.dtype).index_put((targets,), picked)
    ent = None
    if entropy:
        with torch.no_grad():
            per_token = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [M]
        ent = torch.zeros(mb.num_tokens).index_put((targets,), per_token)
    return logp, ent, out.hidden_states[-1][0] if hidden else None
