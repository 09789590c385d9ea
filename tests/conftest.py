"""Shared fixtures: the real tokenizer (no network) and a tiny random-initialised model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from agent_r1.models import resolve_model_path
from agent_r1.rollout.local_engine import LocalEngine


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer from the bundled model (converted once into the cache)."""
    return AutoTokenizer.from_pretrained(resolve_model_path("default"))


def make_tiny_llama(vocab_size: int, hidden: int = 64, eos: int = 2, pad: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights: fast, deterministic, exercises GQA, RoPE and the KV cache."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)


@pytest.fixture
def engine(tiny_model, tokenizer):
    return LocalEngine(tiny_model, tokenizer, seed=0, max_context=1024)


def recompute_logprobs(model, input_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of every token given its prefix, from one plain forward pass: [T-1]."""
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float() / temperature  # [T-1, V]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
