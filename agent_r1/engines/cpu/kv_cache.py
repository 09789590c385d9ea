"""The local engine's KV memory: one slot (a row of a preallocated buffer) per sequence.

Continuous batching needs sequences of different lengths to join and leave a running batch at any
decode step, and a multi-turn agent needs a trajectory's keys and values to outlive its turn. Both are
easy when every sequence owns a slot: its keys and values sit in columns 0..n-1 of its own row of
each layer's `[2, slots, kv_heads, capacity, head_dim]` buffer, so the key of position p is always at
column p. (One tensor per layer, not one for all of them: growing the buffers reallocates a layer at a
time, so the old and the new buffers are never both whole in memory.)
A decode step writes each row's new token at that row's own column (not at a shared "end" as in a
left-padded batch), and its attention reads only its own columns (`slot_attention`). Nothing is ever
left-padded, so rows of any length decode together and a row can be dropped or added by moving one
slot, not by re-aligning the batch. (vLLM gets the same freedom from paged attention; a slot is one
page as long as the sequence, which is what plain PyTorch attention can read as a strided view.)

Every column an attention reads holds a finite value, so a masked column cannot turn an attention score
into NaN, whichever SDPA kernel adds the mask: columns are zeroed up to the widest read so far
(`clean`), lazily, so the memory of columns never read is never touched (nor resident).

A forward pass is *packed*: the tokens of every sequence that takes part - one per decoding row, a chunk
of its prompt per row being prefilled - are one row `[1, T]`, so the linear layers see every token of
the step in one matmul and a newcomer's prefill rides in a decode step instead of stalling it (chunked
prefill, Agrawal et al., "Sarathi-Serve", OSDI 2024; vLLM's scheduler). Attention is the only part that
needs to know which tokens belong together, and `slot_attention` does it per `Segment`. On the CPU,
in fp32, one call of the `decode_attention` kernel takes every token of the pass, each reading its own
slot's columns up to its own. Otherwise SDPA does: a run of decoding rows in consecutive slots reads
their slots only up to the longest of *them* (not the widest row of the batch), and a prefill chunk
reads its own slot with a causal mask offset by the columns it already holds. It is registered with
transformers' `AttentionInterface` (`use_slot_attention`), and a forward pass outside `SlotCache.packed`
(the trainer's) falls through to SDPA unchanged.

In those kernel passes a Llama-family attention layer runs `FusedSlotAttention`: the rotary embedding and
the slot writes in one C++ op, bitwise transformers' forward.

`SlotCache` speaks transformers' `Cache` interface: `packed(slots, cols, segments)` says which slot and
column each token's keys go to; each layer's `update` writes them there and returns the layer's whole
buffer, which `slot_attention` reads by segment. Inference only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from agent_r1.engines.cpu.decode_attention import kernel_for
from agent_r1.engines.protocol import SLOT_ATTENTION
from agent_r1.models.onednn import ForwardMixin, mix_in

ZERO_AHEAD = 64  # columns `read_up_to` makes finite at a time
_ACTIVE: contextvars.ContextVar[SlotCache | None] = contextvars.ContextVar("agent_r1_slot_cache", default=None)


@dataclass(eq=False)
class Segment:
    """Tokens [token, token + count) of a packed pass that attend as one SDPA call.

    `decode`: one token per row, rows in slots slot .. slot + count - 1, or, for the CPU kernel
    (`decode_attention`), tokens in any slots (`slot_of` [count]), each reading only its own slot's columns
    up to its own: a decoding row's new token, or a prompt chunk's tokens, causally; otherwise `count`
    tokens of the one sequence in `slot` (a prefill chunk). `cols` [count] are the
    tokens' columns (= positions for the mask); the segment reads columns 0 .. width - 1 of its slots,
    width = max(cols) + 1 (a sliding-window layer only those its window reaches: `blocks`).
    """

    token: int
    count: int
    slot: int
    decode: bool
    cols: torch.Tensor  # [count]
    width: int  # max(cols) + 1, the columns it reads (given from the host: no device read)
    lowest: int  # min(cols)
    slot_of: torch.Tensor | None = None  # [count] each token's slot: the tokens go to the CPU kernel
    _blocks: dict = field(default_factory=dict)

    def bounds(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The columns [start, end) each decoding row reads in a layer with this window, for the kernel."""
        if ("bounds", window) not in self._blocks:
            end = self.cols + 1  # [count] its own column and those before
            start = torch.zeros_like(end) if window is None else (end - window).clamp_(min=0)
            self._blocks["bounds", window] = (start, end)
        return self._blocks["bounds", window]

    def blocks(self, window: int | None) -> list[tuple[slice, slice, torch.Tensor | None]]:
        """How the segment attends in a layer with this window, one SDPA call a block: (its tokens in the
        pass, the columns they read, which of those each sees, or None where nothing is hidden: rows of
        one length, a chunk from column 0 under `is_causal`). Built once per pass and window, shared by
        every layer.

        Why blocks: a sliding-window layer (Gemma 3: 512 columns in 5 of every 6 layers) reads from its
        lowest token's window on, not from column 0, where a τ² conversation holds 6-8k columns. A prompt
        chunk longer than the window is cut into blocks of `window` queries that read 2 x window - 1
        columns each, so its attention grows linearly with its length, not quadratically (the banded
        attention of Longformer, Beltagy et al. 2020, as blocks)."""
        if window not in self._blocks:
            n, step = self.count, self.count if self.decode or window is None else window
            self._blocks[window] = [self._block(a, min(a + step, n), window) for a in range(0, n, step)]
        return self._blocks[window]

    def _block(self, a: int, b: int, window: int | None) -> tuple[slice, slice, torch.Tensor | None]:
        """Tokens a .. b - 1 of the segment as one block (rows: all of them; a chunk's columns run on)."""
        lowest, width = (self.lowest, self.width) if self.decode else (self.lowest + a, self.lowest + b)
        start = 0 if window is None else max(lowest - window + 1, 0)
        cols = self.cols[a:b, None]  # [n, 1]
        kv = torch.arange(start, width, device=cols.device)  # [W]
        sees = kv <= cols  # [n, W] causal: its own column and those before
        if window is not None:
            sees &= cols - kv < window  # a sliding-window layer
        if self.decode:  # rows of one length see every column read
            mask = sees[:, None, None] if lowest + 1 < width else None  # [n, 1, 1, W]
        else:  # a chunk after held columns, or longer than its window
            mask = sees[None, None] if lowest > 0 or (window is not None and width > window) else None  # [1, 1, n, W]
        return slice(self.token + a, self.token + b), slice(start, width), mask


def slot_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs
):
    """transformers' attention interface over a `SlotCache` in a packed pass: query [1, Hq, T, D], key and
    value the layer's buffers [slots, Hkv, capacity, D]; returns [1, T, Hq, D]. Outside a packed pass
    (the trainer's forward passes) it is transformers' SDPA attention, argument for argument."""
    cache = _ACTIVE.get()
    if cache is None:  # looked up: the trainer's tree attention (models/tree_attention.py) is SDPA's entry
        return AttentionInterface._global_mapping["sdpa"](module, query, key, value, *args, **kwargs)
    window, scale = kwargs.get("sliding_window"), kwargs.get("scaling")
    q = query[0]  # [Hq, T, D]
    out = query.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, Hq, D]
    for seg in cache.segments:
        if seg.slot_of is not None:  # every token (decoding rows, prompt chunks) in one call of the CPU kernel
            tokens = slice(seg.token, seg.token + seg.count)
            q_rows = q[:, tokens].transpose(0, 1).contiguous()  # [c, Hq, D]
            kernel = kernel_for(key.dtype, key.device) if q.dtype == torch.float32 else None
            if kernel is not None:
                _kernel_attention(kernel, q_rows, key, value, seg, window, scale or q.shape[2] ** -0.5, out[tokens])
                continue
            # the cache's dtype changed after the pass chose the kernel (it follows the values'): row by row
            grouped = q_rows.view(seg.count, key.shape[1], -1, q.shape[2])  # [c, Hkv, G, D]
            start, end = seg.bounds(window)
            for j, (s, a, b) in enumerate(zip(seg.slot_of.tolist(), start.tolist(), end.tolist(), strict=True)):
                k, v = _as_read(key[s, :, a:b], q), _as_read(value[s, :, a:b], q)
                o = F.scaled_dot_product_attention(grouped[j], k, v, scale=scale)  # [Hkv, G, D]
                out[seg.token + j] = o.reshape(-1, q.shape[2])
            continue
        for tokens, cols, mask in seg.blocks(window):
            if seg.decode:  # each row reads its own slot, only up to the segment's longest row
                rows = slice(seg.slot, seg.slot + seg.count)
                # a kv head's G query heads as G queries of it: its keys are read once, not G times (GQA)
                grouped = q[:, tokens].transpose(0, 1).reshape(seg.count, key.shape[1], -1, q.shape[2])
                # grouped: [c, Hkv, G, D]
                o = F.scaled_dot_product_attention(
                    grouped, _as_read(key[rows, :, cols], q), _as_read(value[rows, :, cols], q),  # [c, Hkv, W, D]
                    attn_mask=mask, scale=scale,
                )  # fmt: skip
                out[tokens] = o.reshape(seg.count, -1, q.shape[2])  # [c, Hq, D]
            else:  # a chunk of one sequence over its slot: causal, offset by the columns it already holds
                row = slice(seg.slot, seg.slot + 1)
                o = F.scaled_dot_product_attention(
                    q[None, :, tokens],  # [1, Hq, k, D]
                    _as_read(key[row, :, cols], q), _as_read(value[row, :, cols], q),  # [1, Hkv, W, D]
                    attn_mask=mask, is_causal=mask is None and tokens.stop - tokens.start > 1, scale=scale,
                    enable_gqa=True,
                )  # fmt: skip
                out[tokens] = o[0].transpose(0, 1)
    return out[None], None


def _kernel_attention(
    kernel,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seg: Segment,
    window: int | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    """A kernel segment's tokens q [c, Hq, D] over a layer's key and value buffers [slots, Hkv, capacity, D],
    each reading its own slot's columns up to its own (within `window`), into out [c, Hq, D]; q and out
    contiguous. A kv head's G query heads go together: its keys are read once for them (GQA)."""
    grouped = (seg.count, key.shape[1], -1, q.shape[-1])  # [c, Hkv, G, D]
    start, end = seg.bounds(window)
    kernel(q.view(grouped), key, value, seg.slot_of, start, end, scale, out.view(grouped))


def _as_read(kv: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Keys or values as SDPA must read them beside `query`: widened to its dtype when the cache stores
    them in bf16 for an fp32 model (`kv_cache_dtype`). Under autocast SDPA casts its inputs itself, and a
    copy of every key read each step would only cost time."""
    if kv.dtype == query.dtype or torch.is_autocast_enabled(kv.device.type):
        return kv
    return kv.to(query.dtype)


# the attention forward bodies `FusedSlotAttention` stands in for: Llama (SmolLM2) and Qwen 2 (its window)
_LLAMA_ATTENTION = [
    "input_shape = hidden_states.shape[:-1]",
    "hidden_shape = (*input_shape, -1, self.head_dim)",
    "query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
    "cos, sin = position_embeddings",
    "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
    "if past_key_values is not None:",
    "key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)",
    "attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(",
    "self.config._attn_implementation, eager_attention_forward",
    ")",
    "attn_output, attn_weights = attention_interface(",
    "self,",
    "query_states,",
    "key_states,",
    "value_states,",
    "attention_mask,",
    "dropout=0.0 if not self.training else self.attention_dropout,",
    "scaling=self.scaling,",
    "**kwargs,",
    ")",
    "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
    "attn_output = self.o_proj(attn_output)",
    "return attn_output, attn_weights",
]
_WINDOW = "sliding_window=self.sliding_window,  # main diff with Llama"
ATTENTION_FORWARDS = (_LLAMA_ATTENTION, [*_LLAMA_ATTENTION[:20], _WINDOW, *_LLAMA_ATTENTION[20:]])


class FusedSlotAttention(ForwardMixin):
    """Mixed into a Llama-family attention class (`ATTENTION_FORWARDS`) by `use_slot_attention`: in a packed
    pass that the CPU kernel takes whole, the layer's rotary embedding and its keys' and values' writes to
    their slots are one C++ op (`rope_store`), and the kernel writes straight into what `o_proj` reads.
    transformers' forward spends ~25 tensor ops a layer on views, the rotation's slices and concatenation,
    two scattered writes and copies between layouts: at 64 decoding rows, small tensors whose overhead
    was 4-29 ms of a 110-150 ms step, and over a prefill pass's thousands of tokens several passes over
    memory (prefill 14-23% faster; docs/log/measurements.md). The results are bitwise the class's own
    forward's (tested). Every other forward (the trainer's, SDPA's passes, bf16 autocast) is the class's
    own."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        cache = _ACTIVE.get()
        fused = cache is not None and past_key_values is cache and cache.kernel_only
        dtype = hidden_states.dtype
        attend = kernel_for(cache.storage or dtype, hidden_states.device) if fused and dtype == torch.float32 else None
        if attend is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        t, d = hidden_states.shape[1], self.head_dim  # hidden_states [1, T, hidden]: a packed pass
        q = self.q_proj(hidden_states)[0].reshape(t, -1, d)  # [T, Hq, D] (a view of a plain linear's output)
        k = self.k_proj(hidden_states)[0].reshape(t, -1, d)  # [T, H, D]
        v = self.v_proj(hidden_states)[0].reshape(t, -1, d)
        cos, sin = (x[0].contiguous() for x in position_embeddings)  # [T, D]
        layer = cache.buffer_for(self.layer_idx, v.dtype)  # [2, slots, H, capacity, D] in the dtype `attend` reads
        torch.ops.agent_r1.rope_store(q, k, v, cos, sin, layer, cache.slot_of, cache.cols)  # q rotated in place
        out = torch.empty_like(q)  # [T, Hq, D]
        window = getattr(self, "sliding_window", None)
        for seg in cache.segments:
            tokens = slice(seg.token, seg.token + seg.count)
            _kernel_attention(attend, q[tokens], layer[0], layer[1], seg, window, self.scaling, out[tokens])
        return self.o_proj(out.view(1, t, -1)), None


AttentionInterface.register(SLOT_ATTENTION, slot_attention)
AttentionMaskInterface.register(SLOT_ATTENTION, sdpa_mask)  # the trainer's masks: as under SDPA


def use_slot_attention(model: PreTrainedModel) -> None:
    """Make the language model's attention layers look up `slot_attention`: SDPA for every forward pass
    but a `SlotCache.packed` one; Llama-family attention layers also get `FusedSlotAttention`. A model on
    another implementation (eager, flash) is refused in one line: its attention would change under the
    trainer too."""
    config = model.config.get_text_config()
    if config._attn_implementation not in ("sdpa", SLOT_ATTENTION):
        raise ValueError(
            f"LocalEngine needs a model loaded with attn_implementation='sdpa', not {config._attn_implementation!r}"
        )
    config._attn_implementation = SLOT_ATTENTION
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj") and not isinstance(module, ForwardMixin):
            mix_in(module, FusedSlotAttention, ATTENTION_FORWARDS)


class SlotCache(Cache):
    """KV memory for up to `slots` sequences of up to `capacity` tokens each, grown on demand."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(layers=[_SlotLayer(self, i) for i in range(num_layers)])
        self.kv_heads, self.head_dim, self.device = kv_heads, head_dim, torch.device(device)
        self.buf: list[torch.Tensor] | None = None  # per layer [2, slots, kv_heads, capacity, head_dim]
        # what keys and values are stored as: `dtype` if given (16 bits for an fp32 model: half the memory
        # and half the bytes each decode step reads), else that of the values the model computes (set by
        # the first forward)
        self.storage = dtype
        self.dtype: torch.dtype | None = dtype
        self.clean = 0  # columns 0..clean-1 of every slot hold finite values
        self.written = 0  # no key or value was written at column `written` or beyond: what growth keeps
        # set by `packed` for one forward pass:
        self.slot_of: torch.Tensor | None = None  # [T] the slot of each token
        self.cols: torch.Tensor | None = None  # [T] the column its key and value go to
        self.segments: list[Segment] = []  # the tokens that attend together
        self.width = 0  # columns any segment reads

    @contextlib.contextmanager
    def packed(self, slot_of: torch.Tensor, cols: torch.Tensor, segments: list[Segment]) -> Iterator[None]:
        """The forward pass run inside is a packed one over this cache: token i's keys go to
        (slot_of[i], cols[i]), and attention runs per segment (`slot_attention`)."""
        self.slot_of, self.cols, self.segments = slot_of, cols, segments
        self.width = max(s.width for s in segments)
        reset = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(reset)
            self.slot_of, self.cols, self.segments = None, None, []

    @property
    def kernel_only(self) -> bool:
        """Every segment of the pass is the CPU kernel's: no token reads a column past its own."""
        return all(s.slot_of is not None for s in self.segments)

    @property
    def slots(self) -> int:
        return 0 if self.buf is None else self.buf[0].shape[1]

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf[0].shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return 0 if self.buf is None else sum(b.nbytes for b in self.buf)

    def bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes one token's keys and values take over all layers."""
        item = torch.empty((), dtype=dtype or self.dtype or torch.float32).element_size()
        return len(self.layers) * 2 * self.kv_heads * self.head_dim * item

    def reserve(self, slots: int, capacity: int, dtype: torch.dtype | None = None) -> None:
        """Reallocate to exactly `slots` sequences of at least `capacity` tokens (capacity never
        shrinks); the slots both buffers have keep what they hold. One layer at a time: at most one
        layer's old buffer is held beside the new ones, not a whole second cache."""
        dtype = dtype or self.dtype or torch.float32
        capacity = max(capacity, self.capacity)
        if self.buf is not None and (slots, capacity, dtype) == (self.slots, self.capacity, self.dtype):
            return
        keep, held = min(slots, self.slots), max(self.clean, self.written)
        old, self.buf = self.buf, []
        for i in range(len(self.layers)):
            new = torch.empty((2, slots, self.kv_heads, capacity, self.head_dim), dtype=dtype, device=self.device)
            if old is not None:
                new[:, :keep, :, :held] = old[i][:, :keep, :, :held]
                old[i] = None  # freed before the next layer's buffer is allocated
            new[:, keep:, :, : self.clean] = 0
            self.buf.append(new)
        self.dtype = dtype

    def buffer_for(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Layer `index`'s buffer [2, slots, H, capacity, D], ready to take this pass's keys and values
        (computed as `dtype`; stored as `storage` if set): in that dtype, its columns finite where SDPA
        will read them."""
        if self.slot_of is None:
            raise RuntimeError("a SlotCache is only read inside SlotCache.packed (with slot attention)")
        dtype = self.storage or dtype
        if self.buf is None or dtype != self.dtype:
            self.reserve(self.slots, self.capacity, dtype)
        if not self.kernel_only:
            self.read_up_to(self.width)
        self.written = max(self.written, self.width)
        return self.buf[index]

    def read_up_to(self, width: int) -> None:
        """Make columns 0..width-1 of every slot finite before an SDPA attention reads them (behind its mask).
        Zeroed 64 columns ahead (within the capacity): a decode step widens the batch by one column, and
        zeroing one column of every slot and layer each step was 2% of a rollout (strided 256-byte writes).

        Passes the CPU kernel takes whole skip this: each token reads only columns that hold keys, and the
        zeroing (the first touch of every slot's pages, used or not) was 5% of a search rollout. Columns
        such passes wrote hold keys beside never-written ones, so there the non-finite are made 0 instead."""
        if width > self.clean:
            width = min(self.capacity, -(-width // ZERO_AHEAD) * ZERO_AHEAD)
            live = min(max(self.written, self.clean), width)
            for layer in self.buf:
                layer[:, :, :, self.clean : live].nan_to_num_(0.0, 0.0, 0.0)  # the keys stay what they are
                layer[:, :, :, live:width] = 0
            self.clean = width

    def release(self) -> None:
        """Free the buffer (the next `reserve` allocates a new one)."""
        self.buf, self.clean, self.written = None, 0, 0

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` columns of slot `src` to slot `dst`."""
        if n and src != dst:
            for layer in self.buf:
                layer[:, dst, :, :n] = layer[:, src, :, :n]

    def swap(self, a: int, b: int, n_a: int, n_b: int) -> None:
        """Exchange slots `a` and `b`, which hold `n_a` and `n_b` columns."""
        if a == b:
            return
        for layer in self.buf:  # one layer's slot held aside at a time
            held = layer[:, a, :, :n_a].clone()
            layer[:, a, :, :n_b] = layer[:, b, :, :n_b]
            layer[:, b, :, :n_a] = held

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
        """Write the pass's new keys and values ([1, H, T, D]) at their slots and columns; return the
        layer's whole buffers ([slots, H, capacity, D]) for `slot_attention`."""
        c = self.cache
        # Under bf16 autocast the values are bf16 but the keys fp32 (RoPE's fp32 cos and sin promote
        # them); SDPA rounds both to bf16 anyway, so the keys are stored in the values' dtype.
        layer = c.buffer_for(self.index, value_states.dtype)  # [2, slots, H, capacity, D]
        layer[0][c.slot_of, :, c.cols] = key_states[0].transpose(0, 1).to(layer.dtype)  # [T, H, D]
        layer[1][c.slot_of, :, c.cols] = value_states[0].transpose(0, 1).to(layer.dtype)
        return layer[0], layer[1]  # not kept on the layer: a view would keep the buffer alive after `release`

    def get_seq_length(self) -> int:
        return self.cache.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.width, 0

    def get_max_length(self) -> int:
        return -1
