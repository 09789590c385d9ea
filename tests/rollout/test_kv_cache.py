"""SlotCache: rows of different lengths decode together, each at its own columns, as they would alone."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from agent_r1.rollout.kv_cache import SlotCache


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


def test_ragged_rows_decode_as_they_would_alone(tiny_model):
    """Two prompts of lengths 5 and 11 sit in slots 0 and 1 from column 0, unpadded; each decode step
    writes each row's token at its own column and a 4D mask shows each row its own columns."""
    torch.manual_seed(0)
    prompts = [torch.randint(3, 100, (5,)).tolist(), torch.randint(3, 100, (11,)).tolist()]
    cache = slot_cache(tiny_model)
    cache.reserve(slots=2, capacity=32)
    got: list[list[torch.Tensor]] = [[], []]
    last = []
    with torch.inference_mode():
        for slot, p in enumerate(prompts):  # prefill each into its slot
            cache.first, cache.cols, cache.width = slot, torch.arange(len(p))[None], len(p)
            sees = torch.arange(len(p))[None, :, None] >= torch.arange(len(p))[None, None, :]  # causal [1, q, W]
            logits = tiny_model(
                input_ids=torch.tensor([p]), position_ids=torch.arange(len(p))[None],
                attention_mask=sees[:, None], past_key_values=cache, use_cache=True,
            ).logits[0, -1]  # fmt: skip
            got[slot].append(logits)
            last.append(int(logits.argmax()))
        n = torch.tensor([len(p) for p in prompts])  # [2] each row's next column = its position
        for _ in range(6):
            W = int(n.max()) + 1
            cache.first, cache.cols, cache.width = 0, n[:, None], W
            sees = torch.arange(W)[None, None] <= n[:, None, None]  # [2, 1, W]
            logits = tiny_model(
                input_ids=torch.tensor(last)[:, None], position_ids=n[:, None],
                attention_mask=sees[:, None], past_key_values=cache, use_cache=True,
            ).logits[:, -1]  # fmt: skip
            for r in range(2):
                got[r].append(logits[r])
            last, n = logits.argmax(-1).tolist(), n + 1
    for r, p in enumerate(prompts):
        want = alone(tiny_model, p, 7)
        assert [int(x.argmax()) for x in got[r]] == [int(x.argmax()) for x in want]
        assert max((a - b).abs().max().item() for a, b in zip(got[r], want, strict=True)) < 1e-4


def test_growth_moves_and_swaps_keep_what_slots_hold():
    cache = SlotCache(num_layers=2, kv_heads=1, head_dim=2, device="cpu")
    cache.reserve(slots=2, capacity=4)
    cache.read_up_to(4)
    assert cache.buf.shape == (2, 2, 2, 1, 4, 2) and not cache.buf.any()  # zeros: no NaN behind a mask
    cache.buf[:, :, 0, :, :3] = 1.0
    cache.buf[:, :, 1, :, :2] = 2.0
    cache.reserve(slots=3, capacity=8)
    assert cache.buf.shape == (2, 2, 3, 1, 8, 2)
    assert (cache.buf[:, :, 0, :, :3] == 1).all() and (cache.buf[:, :, 1, :, :2] == 2).all()
    cache.swap(0, 1, n_a=3, n_b=2)
    assert (cache.buf[:, :, 1, :, :3] == 1).all() and (cache.buf[:, :, 0, :, :2] == 2).all()
    cache.move(1, 2, 3)
    assert (cache.buf[:, :, 2, :, :3] == 1).all() and not cache.buf[:, :, 2, :, 3].any()  # a new slot: zeros
    assert cache.bytes_per_token() == 2 * 2 * 1 * 2 * 4
    cache.release()
    assert cache.buf is None and cache.slots == 0
