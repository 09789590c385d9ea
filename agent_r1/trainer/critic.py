"""The PPO critic: a value head on the policy backbone, or a separate model, and GAE onto rows.

Values are read at the state *before* a token is chosen (V for sampled token p comes from the hidden
state at p-1). Step-level GAE uses the value at each step's first sampled token; token-level GAE uses
every sampled token's, with gamma and lambda applied at step boundaries only (algos.advantages.gae).
"""

from __future__ import annotations

import copy

import torch

from agent_r1.algos import advantages as adv_fns
from agent_r1.distributed.group import SINGLE, Dist
from agent_r1.models.precision import autocast
from agent_r1.trainer.batching import MicroBatch, Row, forward_rows, token_logprobs
from agent_r1.trainer.rows import RowIndex


class Critic(torch.nn.Module):
    """PPO critic: a linear value head on the policy's last hidden state ("head": shared backbone)
    or on a separate copy of the model ("separate")."""

    def __init__(self, policy: torch.nn.Module, kind: str) -> None:
        super().__init__()
        hidden = policy.config.hidden_size
        self.shared = kind == "head"
        self.backbone = None if self.shared else copy.deepcopy(policy)
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, mb: MicroBatch, policy_hidden: torch.Tensor | None) -> torch.Tensor:
        """Values aligned to targets: [L], V[p] read from the hidden state at p-1."""
        if self.shared:
            hidden = policy_hidden  # [L, H]
        else:
            with autocast(self.backbone):
                out = self.backbone(
                    input_ids=mb.input_ids[None], position_ids=mb.position_ids[None],
                    output_hidden_states=True, use_cache=False, logits_to_keep=1,
                )  # fmt: skip
            hidden = out.hidden_states[-1][0]
        v = self.head(hidden.float()).squeeze(-1)  # [L] value of the state after each position
        return torch.cat([v.new_zeros(1), v[:-1]])  # [L]


@torch.no_grad()
def fill_old_values(
    critic: Critic, policy: torch.nn.Module, rows: list[Row], micro_batch_tokens: int, dist: Dist = SINGLE
) -> None:
    """Critic values at rollout time (the clipping anchor and the GAE baseline)."""

    def values(mb: MicroBatch) -> torch.Tensor:  # [L]
        return critic(mb, token_logprobs(policy, mb, hidden=True)[2] if critic.shared else None)

    for row, v in zip(rows, forward_rows(policy, rows, micro_batch_tokens, values, dist), strict=True):
        row.old_values = v


def value_mask(mb: MicroBatch, level: str) -> torch.Tensor:
    """Tokens that carry a value target: each step's first sampled token (step level) or all of them."""
    if level == "token":
        return mb.mask
    return (mb.mask.bool() & (torch.roll(mb.seg, 1) != mb.seg)).float()


def set_gae(
    rows: list[Row], where: RowIndex, step_rewards: list[torch.Tensor], gamma: float, lam: float, level: str
) -> None:
    """PPO: advantages and value targets of every row, by GAE over steps or over sampled tokens."""
    by_traj: list[list[tuple[Row, torch.Tensor]]] = [[] for _ in step_rewards]
    for row, ti, sidx in zip(rows, where.row_owner, where.step_index, strict=True):
        by_traj[ti].append((row, sidx))
    for ti, parts in enumerate(by_traj):
        if not parts:
            continue
        if level == "step":
            values = torch.zeros(len(step_rewards[ti]))  # [K] value before each step
            for row, sidx in parts:
                for k in sidx[sidx >= 0].unique().tolist():
                    values[k] = row.old_values[int((sidx == k).nonzero()[0])]
            (adv,), (ret,) = adv_fns.gae([step_rewards[ti]], [values], gamma, lam)
            for row, sidx in parts:
                row.adv = adv_fns.token_advantages([adv], sidx, torch.zeros_like(sidx)).float()
                row.returns = torch.zeros(len(sidx))
                for k in sidx[sidx >= 0].unique().tolist():
                    row.returns[int((sidx == k).nonzero()[0])] = ret[k]
            continue
        n = where.step_tokens[ti]  # [K]
        token_r = adv_fns.rewards_on_last_token([step_rewards[ti]], [n])[0]  # [S]
        if not len(token_r):  # no sampled token (empty responses): nothing to credit
            continue
        ends = torch.zeros(len(token_r), dtype=torch.bool)
        ends[(n.long().cumsum(0) - 1).clamp(min=0)] = True  # [S] last token of each step
        values = torch.cat([row.old_values[row.mask.bool()] for row, _ in parts])  # [S]
        (adv,), (ret,) = adv_fns.gae([token_r], [values], gamma, lam, step_ends=[ends])
        offset = 0
        for row, _ in parts:
            pos = row.mask.nonzero().squeeze(-1)
            row.adv = torch.zeros(len(row.mask)).index_put((pos,), adv[offset : offset + len(pos)].float())
            row.returns = torch.zeros(len(row.mask)).index_put((pos,), ret[offset : offset + len(pos)].float())
            offset += len(pos)
