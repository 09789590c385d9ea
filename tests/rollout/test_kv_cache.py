"""BufferedCache: the logits of DynamicCache, bit for bit, through prefix sharing, dropped rows and growth."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from agent_r1.rollout.kv_cache import BufferedCache


def decode(model, cache, prefix: int = 6, rows: int = 4, steps: int = 9) -> list[torch.Tensor]:
    """Prefill a shared prefix once, copy it to `rows` rows, add a per-row token, then decode greedily,
    dropping rows 0 and 2 after 3 steps (as the engine does with finished rows). Returns every step's logits."""
    torch.manual_seed(1)
    shared = torch.randint(3, 100, (1, prefix))
    out = []
    with torch.inference_mode():
        model(input_ids=shared, past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(rows)
        tokens = torch.randint(3, 100, (rows, 1))
        positions = torch.full((rows, 1), prefix)
        for step in range(steps):
            if step == 3:
                keep = torch.tensor([1, 3])
                cache.batch_select_indices(keep)
                tokens, positions = tokens[keep], positions[keep]
            logits = model(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True).logits
            out.append(logits[:, -1])
            tokens, positions = logits[:, -1].argmax(-1, keepdim=True), positions + 1
    return out


@pytest.mark.parametrize("capacity", [16, 8, 1], ids=["roomy", "grows-once", "grows-often"])
def test_logits_equal_dynamic_cache(tiny_model, capacity):
    expected = decode(tiny_model, DynamicCache())
    got = decode(tiny_model, BufferedCache(capacity=capacity))
    assert len(got) == len(expected) == 9
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_seq_length_follows_the_writes(tiny_model):
    cache = BufferedCache(capacity=32)
    with torch.inference_mode():
        tiny_model(input_ids=torch.randint(3, 100, (2, 5)), past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 5
        tiny_model(input_ids=torch.randint(3, 100, (2, 1)), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 6
    assert cache.layers[0].keys.shape[-2] == 6 and cache.layers[0]._k.shape[-2] == 32  # no copy per token
