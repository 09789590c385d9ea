"""The local engine's KV memory: one slot (a row of a preallocated buffer) per sequence.

Continuous batching needs sequences of different lengths to join and leave a running batch at any
decode step, and a multi-turn agent needs a trajectory's keys and values to outlive its turn. Both are
easy when every sequence owns a slot: its keys and values sit in columns 0..n-1 of its own row of one
`[layers, 2, slots, kv_heads, capacity, head_dim]` buffer, so the key of position p is always at column
p. A decode step writes each row's new token at that row's own column (not at a shared "end" as in a
left-padded batch), and a 4D attention mask says which columns each row may see. Nothing is ever
left-padded, so rows of any length decode together and a row can be dropped or added by moving one
slot, not by re-aligning the batch. (vLLM gets the same freedom from paged attention; a slot is one
page as long as the sequence, which is what plain PyTorch attention can read as a strided view.)

Every column an attention reads holds a finite value, so a masked column cannot turn an attention score
into NaN, whichever SDPA kernel adds the mask: columns are zeroed up to the widest read so far
(`clean`), lazily, so the memory of columns never read is never touched (nor resident).

`SlotCache` speaks transformers' `Cache` interface: before each forward pass the engine says which
slots the batch occupies (`rows`), where each new token's key goes (`cols`) and how many columns the
attention reads (`width`); each layer's `update` writes there and returns views of those rows.
Inference only: the views are overwritten in place by later steps.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotCache(Cache):
    """KV memory for up to `slots` sequences of up to `capacity` tokens each, grown on demand."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device: torch.device | str) -> None:
        super().__init__(layers=[_SlotLayer(self, i) for i in range(num_layers)])
        self.kv_heads, self.head_dim, self.device = kv_heads, head_dim, torch.device(device)
        self.buf: torch.Tensor | None = None  # [layers, 2, slots, kv_heads, capacity, head_dim]
        self.dtype: torch.dtype | None = None  # that of the keys the model computes (set by the first forward)
        self.clean = 0  # columns 0..clean-1 of every slot hold finite values
        # set by the engine before each forward pass:
        self.first = 0  # the batch's rows are slots first .. first+b-1
        self.cols: torch.Tensor | None = None  # [b, q] the column each new token's key and value go to
        self.width = 0  # columns the attention reads, the same for every row (the mask hides the rest)

    @property
    def slots(self) -> int:
        return 0 if self.buf is None else self.buf.shape[2]

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.shape[4]

    def bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes one token's keys and values take over all layers."""
        item = torch.empty((), dtype=dtype or self.dtype or torch.float32).element_size()
        return len(self.layers) * 2 * self.kv_heads * self.head_dim * item

    def reserve(self, slots: int, capacity: int, dtype: torch.dtype | None = None) -> None:
        """Reallocate to exactly `slots` sequences of at least `capacity` tokens (capacity never
        shrinks); the slots both buffers have keep what they hold."""
        dtype = dtype or self.dtype or torch.float32
        capacity = max(capacity, self.capacity)
        if self.buf is not None and (slots, capacity, dtype) == (self.slots, self.capacity, self.dtype):
            return
        new = torch.empty(
            (len(self.layers), 2, slots, self.kv_heads, capacity, self.head_dim), dtype=dtype, device=self.device
        )
        keep = min(slots, self.slots)
        if self.buf is not None:
            new[:, :, :keep, :, : self.clean] = self.buf[:, :, :keep, :, : self.clean]
        new[:, :, keep:, :, : self.clean] = 0
        self.buf, self.dtype = new, dtype

    def read_up_to(self, width: int) -> None:
        """Make columns 0..width-1 of every slot finite before an attention reads them."""
        if width > self.clean:
            self.buf[:, :, :, :, self.clean : width] = 0
            self.clean = width

    def release(self) -> None:
        """Free the buffer (the next `reserve` allocates a new one)."""
        self.buf, self.clean = None, 0

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` columns of slot `src` to slot `dst`."""
        if n and src != dst:
            self.buf[:, :, dst, :, :n] = self.buf[:, :, src, :, :n]

    def swap(self, a: int, b: int, n_a: int, n_b: int) -> None:
        """Exchange slots `a` and `b`, which hold `n_a` and `n_b` columns."""
        if a == b:
            return
        held = self.buf[:, :, a, :, :n_a].clone()
        self.move(b, a, n_b)
        self.buf[:, :, b, :, :n_a] = held

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    @property
    def is_compileable(self) -> bool:
        return False


class _SlotLayer(CacheLayerMixin):
    """One layer's view of the `SlotCache` buffer."""

    def __init__(self, cache: SlotCache, index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the batch's new keys and values ([b, H, q, D]) at their columns; return the rows'
        first `width` columns ([b, H, width, D] views)."""
        c = self.cache
        if c.buf is None or key_states.dtype != c.dtype:  # autocast decides the dtype of the keys
            c.reserve(c.slots, c.capacity, key_states.dtype)
        c.read_up_to(c.width)
        b, q = key_states.shape[0], key_states.shape[2]
        rows = torch.arange(c.first, c.first + b, device=c.cols.device)[:, None].expand(b, q)  # [b, q]
        layer = c.buf[self.index]  # [2, slots, H, capacity, D]
        layer[0][rows, :, c.cols] = key_states.transpose(1, 2)  # [b, q, H, D]
        layer[1][rows, :, c.cols] = value_states.transpose(1, 2)
        span = slice(c.first, c.first + b)
        self.keys, self.values = layer[0, span, :, : c.width], layer[1, span, :, : c.width]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cache.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.width, 0

    def get_max_length(self) -> int:
        return -1
