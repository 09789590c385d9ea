"""SlotCache: rows of different lengths decode together, each at its own columns, as they would alone."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from agent_r1.engines.cpu import kv_cache
from agent_r1.engines.cpu.kv_cache import SLOT_ATTENTION, Segment, SlotCache, use_slot_attention
from agent_r1.engines.cpu.local_engine import _row_runs
from tests.conftest import make_tiny_llama


def slot_cache(model) -> SlotCache:
    cfg = model.config
    return SlotCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, "cpu")


def alone(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Greedy logits of one row with transformers' own cache: the reference."""
    cache, out, ids = DynamicCache(), [], torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits[0])
            ids = logits.argmax(-1, keepdim=True)
    return out


def packed_pass(model, cache, feeds):
    """One packed forward pass, laid out by hand: `feeds` is a list of (slot, first column, token ids,
    decode) in token order; decode feeds of consecutive slots form one segment. Returns the logits [T, V]."""
    slots, cols, ids, segments, t = [], [], [], [], 0
    for slot, col, toks, _ in feeds:
        slots += [slot] * len(toks)
        cols += range(col, col + len(toks))
        ids += toks
    col_t = torch.tensor(cols)
    while t < len(feeds):
        slot, col, toks, decode = feeds[t]
        if decode:  # a run of single tokens in consecutive slots
            j = t
            while j + 1 < len(feeds) and feeds[j + 1][3] and feeds[j + 1][0] == feeds[j][0] + 1:
                j += 1
            first = sum(len(f[2]) for f in feeds[:t])
            run = [f[1] for f in feeds[t : j + 1]]
            segments.append(
                Segment(first, j + 1 - t, slot, True, col_t[first : first + len(run)], max(run) + 1, min(run))
            )
            t = j + 1
        else:
            first = sum(len(f[2]) for f in feeds[:t])
            segments.append(
                Segment(first, len(toks), slot, False, col_t[first : first + len(toks)], col + len(toks), col)
            )
            t += 1
    with cache.packed(torch.tensor(slots), col_t, segments):
        out = model(
            input_ids=torch.tensor([ids]), position_ids=col_t[None],
            attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool), past_key_values=cache, use_cache=True,
        )  # fmt: skip
    return out.logits[0]


def test_packed_passes_of_decode_rows_and_prompt_chunks_match_each_row_alone(tokenizer):
    """Rows of lengths 5 and 11 and a newcomer of 9, unpadded in slots 0-2: the first pass prefills one
    prompt whole and the first 6 tokens of another; the next decodes row 0 beside the rest of that prompt
    (a chunk after 6 held columns); the newcomer's whole prompt then rides in a decode step of the two;
    then all three decode in one segment, each reading its own columns. Every logit is what the row
    alone gets from transformers' own cache, and the trainer's plain forward is untouched."""
    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=3)
    use_slot_attention(model)
    torch.manual_seed(0)
    p0, p1, p2 = (torch.randint(3, 100, (n,)).tolist() for n in (5, 11, 9))
    cache = slot_cache(model)
    cache.reserve(slots=3, capacity=64)
    got: list[list[torch.Tensor]] = [[], [], []]
    with torch.inference_mode():
        logits = packed_pass(model, cache, [(0, 0, p0, False), (1, 0, p1[:6], False)])
        got[0].append(logits[4])
        t0 = int(logits[4].argmax())
        logits = packed_pass(model, cache, [(0, 5, [t0], True), (1, 6, p1[6:], False)])
        got[0].append(logits[0])
        got[1].append(logits[-1])
        last, n = [int(logits[0].argmax()), int(logits[-1].argmax())], [6, 11]
        logits = packed_pass(model, cache, [(0, n[0], [last[0]], True), (1, n[1], [last[1]], True), (2, 0, p2, False)])
        for r in range(2):
            got[r].append(logits[r])
        got[2].append(logits[-1])
        last, n = [int(logits[0].argmax()), int(logits[1].argmax()), int(logits[-1].argmax())], [7, 12, 9]
        for _ in range(5):
            logits = packed_pass(model, cache, [(r, n[r], [last[r]], True) for r in range(3)])
            for r in range(3):
                got[r].append(logits[r])
            last, n = [int(x.argmax()) for x in logits], [c + 1 for c in n]
    for r, p in enumerate((p0, p1, p2)):
        want = alone(model, p, len(got[r]))
        assert [int(x.argmax()) for x in got[r]] == [int(x.argmax()) for x in want]
        assert max((a - b).abs().max().item() for a, b in zip(got[r], want, strict=True)) < 1e-4


def test_outside_a_packed_pass_slot_attention_is_sdpa_bit_for_bit(tokenizer):
    """The engine's model is the trainer's: its forward and backward passes must not change."""
    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=4)
    ids = torch.randint(3, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding: a real mask

    def run():
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    before, grads = run()
    use_slot_attention(model)
    after, grads2 = run()
    assert model.config._attn_implementation == SLOT_ATTENTION
    assert torch.equal(before, after) and all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))


def test_a_model_on_another_attention_is_refused_in_one_line(tokenizer):
    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attn_implementation='sdpa', not 'eager'"):
        use_slot_attention(model)


def test_decoding_rows_split_where_unlike_lengths_pay_for_another_call():
    def rows(slots_and_lengths):
        return [SimpleNamespace(slot=s, n=n) for s, n in slots_and_lengths]

    # two short rows beside two long ones: 4 x 501 + 128 to read together, 2 x 11 + 2 x 501 + 2 x 128 apart
    assert _row_runs(rows([(0, 10), (1, 10), (2, 500), (3, 500)])) == [(0, 2), (2, 4)]
    assert _row_runs(rows([(0, 100), (1, 101), (2, 102)])) == [(0, 3)]  # alike: one call
    assert _row_runs(rows([(0, 100), (2, 100), (3, 100)])) == [(0, 1), (1, 3)]  # slot 1 is not decoding
    # 3 x 301 + 128 = 1031 together; 301 + 251 + 301 + 3 x 128 = 1237 apart
    assert _row_runs(rows([(0, 300), (1, 250), (2, 300)])) == [(0, 3)]
    # 3 x 301 + 128 = 1031 together; 301 + 11 + 301 + 3 x 128 = 997 apart
    assert _row_runs(rows([(0, 300), (1, 10), (2, 300)])) == [(0, 1), (1, 2), (2, 3)]
    assert _row_runs([]) == []


def test_growth_moves_and_swaps_keep_what_slots_hold():
    cache = SlotCache(num_layers=2, kv_heads=1, head_dim=2, device="cpu")
    cache.reserve(slots=2, capacity=4)
    cache.read_up_to(4)

    def buf():  # the layers' buffers as one [layers, 2, slots, kv_heads, capacity, head_dim] tensor
        return torch.stack(cache.buf)

    assert buf().shape == (2, 2, 2, 1, 4, 2) and not buf().any()  # zeros: no NaN behind a mask
    for layer in cache.buf:
        layer[:, 0, :, :3] = 1.0
        layer[:, 1, :, :2] = 2.0
    cache.reserve(slots=3, capacity=8)
    assert buf().shape == (2, 2, 3, 1, 8, 2) and cache.nbytes == 2 * 2 * 3 * 1 * 8 * 2 * 4
    assert (buf()[:, :, 0, :, :3] == 1).all() and (buf()[:, :, 1, :, :2] == 2).all()
    cache.swap(0, 1, n_a=3, n_b=2)
    assert (buf()[:, :, 1, :, :3] == 1).all() and (buf()[:, :, 0, :, :2] == 2).all()
    cache.move(1, 2, 3)
    assert (buf()[:, :, 2, :, :3] == 1).all() and not buf()[:, :, 2, :, 3].any()  # a new slot: zeros
    assert cache.bytes_per_token() == 2 * 2 * 1 * 2 * 4
    cache.release()
    assert cache.buf is None and cache.slots == 0


def write(cache: SlotCache, slot: int, cols: range, value: float, kernel: bool) -> None:
    """One packed pass's keys and values (all `value`) at `cols` of `slot`, as every layer writes them;
    `kernel`: the pass is the CPU kernel's alone (its one segment carries each token's slot)."""
    t = len(cols)
    slot_of, col_t = torch.full((t,), slot), torch.tensor(list(cols))
    segment = Segment(0, t, slot, True, col_t, cols[-1] + 1, cols[0], slot_of if kernel else None)
    kv = torch.full((1, cache.kv_heads, t, cache.head_dim), value)
    with cache.packed(slot_of, col_t, [segment]):
        for layer in cache.layers:
            layer.update(kv, kv)


def test_kernel_passes_skip_the_zeroing_and_growth_and_a_later_sdpa_pass_keep_their_keys():
    """A pass the CPU kernel takes whole reads only written columns, so nothing is zeroed for it (the
    first touch of every slot's pages). Growing the buffer still keeps what such passes wrote, and an
    SDPA pass after them makes the columns it may read finite without touching a key."""
    cache = SlotCache(num_layers=2, kv_heads=1, head_dim=2, device="cpu")
    cache.reserve(slots=2, capacity=8)
    for layer in cache.buf:
        layer.fill_(float("nan"))  # what torch.empty may hold
    write(cache, 0, range(0, 5), 1.0, kernel=True)
    assert cache.clean == 0 and cache.written == 5
    cache.reserve(slots=3, capacity=16)
    buf = torch.stack(cache.buf)  # [layers, 2, slots, kv_heads, capacity, head_dim]
    assert (buf[:, :, 0, :, :5] == 1).all()  # growth copied the written columns
    for layer in cache.buf:
        layer[:, :, :, 5:].fill_(float("inf"))  # never written: anything
        layer[:, 1:].fill_(float("nan"))
    write(cache, 1, range(0, 3), 2.0, kernel=False)  # SDPA reads up to 3 columns of every slot, behind masks
    buf = torch.stack(cache.buf)
    assert cache.clean == 16 and buf.isfinite().all()  # 64 columns ahead, within the capacity
    assert (buf[:, :, 0, :, :5] == 1).all() and (buf[:, :, 1, :, :3] == 2).all()  # the keys are kept
    assert not buf[:, :, 0, :, 5:].any() and not buf[:, :, 2].any()  # the rest is zeros


def test_growing_the_buffers_never_holds_a_second_whole_cache():
    """Growth used to allocate the new [layers, ...] buffer beside the old one, so for a moment the cache
    took its old size plus its new size (an eval's 4 GB cache, 8 GB and more). Now each layer's old
    buffer is freed before the next layer's new one is allocated: the most held during a growth is the
    new cache plus one old layer."""
    layers, old_layer = 6, 2 * 4 * 1 * 64 * 2 * 4  # bytes of one layer's [2, slots=4, kv=1, capacity=64, dim=2]
    cache = SlotCache(num_layers=layers, kv_heads=1, head_dim=2, device="cpu")
    cache.reserve(slots=4, capacity=64)
    cache.read_up_to(64)
    old = cache.buf  # reserve frees its layers from this list as it goes
    peaks, allocate = [], torch.empty

    def counting_empty(shape, **kwargs):  # what is held once this allocation is made
        held = sum(b.nbytes for b in [*cache.buf, *old] if b is not None)
        peaks.append(held + math.prod(shape) * 4)
        return allocate(shape, **kwargs)

    torch.empty = counting_empty
    try:
        cache.reserve(slots=4, capacity=128)
    finally:
        torch.empty = allocate
    assert cache.nbytes == 2 * old_layer * layers  # twice the columns
    assert max(peaks) == cache.nbytes + old_layer  # the old code: cache.nbytes + layers * old_layer


def test_bf16_stored_keys_are_widened_for_fp32_queries_and_left_to_autocast_under_it():
    """A bf16 cache for an fp32 model (`kv_cache_dtype`) gives SDPA its keys in fp32, the same values;
    under autocast SDPA casts its inputs itself, so the stored tensor is passed as it is (no copy a step)."""
    keys, query = torch.randn(2, 3, 5, 8).to(torch.bfloat16), torch.randn(1, 3, 1, 8)
    widened = kv_cache._as_read(keys, query)
    assert widened.dtype == torch.float32 and torch.equal(widened, keys.float())
    assert kv_cache._as_read(keys, query.bfloat16()) is keys
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kv_cache._as_read(keys, query) is keys
