"""Attention over a trie of rows run as one sequence (trainer/batching.py), each row's new tokens reading only
the keys on their own path: the cost of a branch is its own tokens times its path, not the whole sequence.

A micro-batch's rows, sorted by their ids, become one sequence holding each trie node once: row k adds its
tokens [a, b) after everything before them, and reads first the `c` tokens it shares with earlier rows (its
`path`, indices into the sequence). A dense [L', L'] mask over the sequence says the same, but SDPA then
computes every query against every key, and on a long agent trace (a 12k-token harness prompt shared by a
dozen branches) that costs more than running the rows one by one. Here attention runs once per row: its
queries against its path's keys and its own, under a causal mask aligned to the bottom right (query i of
the row sees the c path keys and its own keys up to i), with the layer's sliding window by position. The
result is the rows' own attention, exactly (tests/trainer/test_batching.py).

The tree goes to every attention layer as a keyword argument of the model's forward (`TREE_KWARG`), which
transformers passes down (and activation checkpointing keeps for the recomputation); `tree_sdpa` replaces
transformers' SDPA attention and is SDPA itself for any forward without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

TREE_KWARG = "agent_r1_tree"


@dataclass
class Tree:
    """The rows of one shared sequence: per row, its new tokens' span and the indices of every key it reads."""

    spans: list[tuple[int, int]]  # [a, b): the row's new tokens in the sequence
    keys: list[torch.Tensor]  # long [c + b - a]: its path's indices, then a..b-1
    masks: list[torch.Tensor]  # [1, 1, b - a, c + b - a]: query i sees keys j <= c + i (bool, or 0 / -inf)

    def to(self, device: torch.device | str) -> Tree:
        return Tree(self.spans, [k.to(device) for k in self.keys], [m.to(device) for m in self.masks])

    def additive(self, dtype: torch.dtype) -> Tree:
        """The masks as SDPA would turn booleans into them (0 where seen, -inf elsewhere), made once for every
        layer: SDPA on the CPU in fp32 would otherwise make and keep one per layer for backward."""
        masks = [torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf")) for m in self.masks]
        return Tree(self.spans, self.keys, masks)


def tree(spans: list[tuple[int, int]], paths: list[torch.Tensor]) -> Tree:
    """The `Tree` of rows whose new tokens are `spans` and whose shared tokens are at `paths` (long [c])."""
    keys, masks = [], []
    for (a, b), path in zip(spans, paths, strict=True):
        c, m = len(path), b - a
        keys.append(torch.cat([path, torch.arange(a, b)]))
        masks.append((torch.arange(c + m)[None, :] <= c + torch.arange(m)[:, None])[None, None])  # [1, 1, m, c+m]
    return Tree(spans, keys, masks)


def tree_sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: query [1, Hq, L', D], key and value [1, Hkv, L', D] -> [1, L', Hq, D],
    row by row along `kwargs[TREE_KWARG]`; without a tree, transformers' SDPA attention unchanged."""
    t: Tree | None = kwargs.pop(TREE_KWARG, None)
    if t is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.pop("sliding_window", None)
    kwargs.pop("is_causal", None)
    outs = []
    for (a, b), keys, mask in zip(t.spans, t.keys, t.masks, strict=True):
        if a == b:  # a row whose every token an earlier row holds (a duplicate): nothing of its own to compute
            continue
        if window is not None:  # query i (position c + i) sees keys j with c + i - j < window
            c, m = len(keys) - (b - a), b - a
            near = (c + torch.arange(m, device=keys.device)[:, None] - torch.arange(c + m, device=keys.device)) < window
            mask = mask.masked_fill(~near, float("-inf")) if mask.dtype != torch.bool else mask & near
        k, v = key.index_select(2, keys), value.index_select(2, keys)  # [1, Hkv, c + m, D]
        out, _ = sdpa_attention_forward(module, query[:, :, a:b], k, v, mask, is_causal=False, **kwargs)
        outs.append(out)  # [1, m, Hq, D]
    return torch.cat(outs, dim=1), None


AttentionInterface.register("sdpa", tree_sdpa)  # SDPA itself for every forward that passes no tree
