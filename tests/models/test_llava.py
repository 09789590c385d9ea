"""LLaVA built from parts: the language model's weights kept, the tower aligned to read digits."""

import copy

import torch

from agent_r1.models.llava import align_to_digits, build_llava
from tests.conftest import make_tiny_llama


def test_the_built_model_keeps_the_language_model_and_adds_one_image_token(tokenizer):
    lm = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    model, processor = build_llava(lm, tokenizer, image_size=16, patch_size=8)
    assert len(processor.tokenizer) == len(tokenizer) + 1 and "<image>" not in tokenizer.get_vocab()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits[..., : len(tokenizer)], lm(ids).logits, atol=1e-5)
    assert model.config.image_token_index == len(tokenizer)


def test_alignment_teaches_the_tower_to_read_held_out_digits(tiny_llava):
    """Trained on the train split's handwriting, the tower's feature of a test-split digit is nearest to
    that digit's token embedding far more often than chance (10%); the language model is untouched."""
    model, processor = tiny_llava
    model = copy.deepcopy(model)
    text = {n: p.detach().clone() for n, p in model.named_parameters() if "language_model" in n}
    accuracy = align_to_digits(model, processor, steps=150)
    assert accuracy > 0.8
    assert all(torch.equal(p, text[n]) for n, p in model.named_parameters() if "language_model" in n)
