"""A fixed batch of training rows for the distributed tests: groups sharing a prompt (so the shared-
prefix path runs), rows of different lengths, several steps per row."""

from __future__ import annotations

import torch

from agent_r1.trainer.batching import Row


def synthetic_rows(n: int = 9, vocab: int = 64, critic: bool = False, kl: bool = False) -> list[Row]:
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, vocab, (40,), generator=g) for _ in range(3)]  # >= 32: shared-prefix passes
    rows = []
    for i in range(n):
        length = 8 + int(torch.randint(0, 30, (1,), generator=g))
        ids = torch.cat([prompts[i % 3], torch.randint(3, vocab, (length,), generator=g)])
        mask = torch.zeros(len(ids))
        mask[40 : 40 + length // 2] = 1.0  # step 0
        mask[42 + length // 2 :] = 1.0  # step 1, after two observation tokens
        seg = torch.full((len(ids),), -1)
        seg[40 : 40 + length // 2] = 2 * i
        seg[42 + length // 2 :] = 2 * i + 1
        adv = torch.randn(len(ids), generator=g) * mask
        row = Row(input_ids=ids, mask=mask, old_logp=torch.zeros(len(ids)), adv=adv, seg=seg)
        if critic:
            row.old_values = torch.randn(len(ids), generator=g) * 0.1
            row.returns = torch.randn(len(ids), generator=g) * mask
        if kl:
            row.ref_logp = -torch.rand(len(ids), generator=g) * mask * 5
        rows.append(row)
    return rows
