"""A decoding KV cache that writes each token in place instead of copying itself every step.

transformers' `DynamicCache` appends every new token with `torch.cat`, which copies the whole cache:
O(T^2) bytes over a response. After a 265-token agent prompt, 16 rows x 64 tokens copy ~15 GB, which
was 41% of the decode time (docs/benchmarks.md). `BufferedCache` keeps each layer in a buffer with
room for `capacity` positions and returns views of its filled part, so a step writes only its own
keys and values. The attention sees the same tensors, so the logits are bitwise those of
`DynamicCache`.

The views are overwritten in place by later steps, so this cache is for inference only (the trainer's
shared-prefix forward keeps `DynamicCache`, which autograd can differentiate through).
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class _BufferedLayer(DynamicLayer):
    """One layer's keys and values in [B, H, capacity, D] buffers; `keys`/`values` view the filled part."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._k: torch.Tensor | None = None  # [B, H, capacity, D]
        self._v: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        if self._k is None:  # the first write gives the shapes
            shape = (*key_states.shape[:2], max(t, self.capacity), key_states.shape[-1])
            self._k, self._v = key_states.new_empty(shape), value_states.new_empty(shape)
        elif n + t > self._k.shape[-2]:  # longer than the capacity hint: grow (correct, just slower)
            self._k, self._v = _grown(self._k, n, n + t), _grown(self._v, n, n + t)
        self._k[:, :, n : n + t] = key_states
        self._v[:, :, n : n + t] = value_states
        self.keys, self.values = self._k[:, :, : n + t], self._v[:, :, : n + t]
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Copy every row `repeats` times (a shared prefix prefilled once, then one copy per row)."""
        n = self.get_seq_length()
        if n == 0:
            return
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows in `indices`, in that order; repeats copy a row (finished rows leave the
        batch, and a distinct prompt's cache is copied to every row that samples from it)."""
        n = self.get_seq_length()
        if n == 0:
            return
        self._k, self._v = self._k[indices], self._v[indices]
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]


def _grown(buffer: torch.Tensor, filled: int, need: int) -> torch.Tensor:
    """A buffer with room for at least `need` positions (doubling), holding the first `filled`."""
    B, H, cap, D = buffer.shape
    out = buffer.new_empty((B, H, max(need, 2 * cap), D))
    out[:, :, :filled] = buffer[:, :, :filled]
    return out


class BufferedCache(DynamicCache):
    """`DynamicCache` with in-place appends; `capacity` = the longest sequence it will hold."""

    def __init__(self, capacity: int) -> None:
        Cache.__init__(self, layer_class_to_replicate=functools.partial(_BufferedLayer, capacity))
