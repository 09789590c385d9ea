"""A LLaVA vision-language model built from parts: a Llama-family causal LM plus a SigLIP vision tower.

No pretrained vision-language model ships in a package this machine can install, so the vision demo
builds a real transformers architecture, `LlavaForConditionalGeneration` (Liu et al., NeurIPS 2023):
the language model keeps its trained weights, a small SigLIP tower (Zhai et al., 2023) and LLaVA's
two-layer projector start random and learn in the cold start. Everything downstream (processor, chat
template, engine, trainer) is what a pretrained LLaVA loaded from a directory goes through.

The processor is built locally too: `LlavaImageProcessorPil` (the torchvision-free one) resizes every
picture to `image_size` square, and each `patch_size` square becomes one placeholder token.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import torch
from transformers import (
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    SiglipVisionConfig,
)
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

IMAGE_TOKEN = "<image>"


def chatml_parts_template(image: str) -> str:
    """ChatML with content parts, an image part rendered as `image` (the model's image markup): SmolLM2's
    template with parts added. The default system line is SmolLM2's own, so the language model sees the
    prompt it was tuned on."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
        "{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ['image', 'image_url'] %}{{ '" + image + "' }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def build_llava(
    language_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    vision_hidden: int = 64,
    vision_layers: int = 2,
    vision_heads: int = 4,
    seed: int = 0,
) -> tuple[LlavaForConditionalGeneration, Any]:
    """A LLaVA model whose language model is `language_model` (its weights, copied) and whose SigLIP
    tower and projector are random (seeded), with its processor, whose tokenizer is a copy of
    `tokenizer` plus the image token (the model's embeddings grow by one row). An image becomes
    (image_size / patch_size)^2 placeholders."""
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    tokenizer = copy.deepcopy(tokenizer)  # the caller's tokenizer stays text-only
    tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = SiglipVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
        vision_use_head=False,  # LLaVA reads the patch states; a pooling head would get no gradient
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=language_model.config,
        image_token_index=image_id,
        vision_feature_select_strategy="full",  # SigLIP has no CLS token to drop
        vision_feature_layer=-1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(language_model.get_decoder().state_dict())
    if not config.tie_word_embeddings:
        model.lm_head.load_state_dict(language_model.get_output_embeddings().state_dict())
    model.generation_config = language_model.generation_config
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.to(language_model.dtype).eval()
    return model, llava_processor(tokenizer, image_size, patch_size)


def llava_processor(tokenizer: PreTrainedTokenizerBase, image_size: int, patch_size: int) -> Any:
    """LLaVA's processor for square `image_size` pictures, with the ChatML-with-parts template."""
    images = LlavaImageProcessorPil(
        size={"height": image_size, "width": image_size},
        do_center_crop=False,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        image_token=IMAGE_TOKEN,
        chat_template=chatml_parts_template(IMAGE_TOKEN),
    )


def align_to_digits(model: LlavaForConditionalGeneration, processor: Any, steps: int = 300, seed: int = 0) -> float:
    """LLaVA's first stage, feature alignment, for handwritten digits: train the vision tower and projector
    (the language model stays as it is) so that each 8x8 patch holding a digit comes out near the language
    model's embedding of that digit's token. Pictures of four digits from the **train** split of
    `load_digits`, 64 a step; about 10 s on 2 cores. Returns the held-out (test split) share of patches
    whose feature is nearest to the right digit's embedding.

    Why: LLaVA aligns a pretrained tower with captions over ~2,000 steps; a random tower learning through
    the 135M model's loss alone, in a cold start of a few dozen steps, did not learn to read (docs/vision.md).
    With labels the tower reads held-out handwriting after a few seconds, and the model then starts where
    a pretrained VLM does: it sees, but knows no task.
    """
    from agent_r1.data.digits import DIGIT_TOKENS, draw, picture

    tokens = torch.tensor(processor.tokenizer.convert_tokens_to_ids(list(DIGIT_TOKENS)))
    targets = model.get_input_embeddings().weight.detach()[tokens]  # [10, H]
    rng = random.Random(seed)

    def batch(n: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        digits = [[rng.randrange(10) for _ in range(4)] for _ in range(n)]
        pictures = [picture(draw(rng, d, split)) for d in digits]  # [16, 16] grey, one digit per patch
        pixels = processor.image_processor(images=[p[..., None].repeat(3, -1) for p in pictures], return_tensors="pt")
        return pixels["pixel_values"], torch.tensor(digits)  # [n, 3, 16, 16], [n, 4]

    def features(pixels: torch.Tensor) -> torch.Tensor:
        return torch.stack(list(model.get_image_features(pixel_values=pixels).pooler_output))  # [n, 4, H]

    params = [p for n, p in model.named_parameters() if "vision_tower" in n or "multi_modal_projector" in n]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    unit = torch.nn.functional.normalize(targets, dim=-1)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model.train()
        for _ in range(steps):
            pixels, digits = batch(64, "train")
            f = features(pixels)
            logits = torch.nn.functional.normalize(f, dim=-1) @ unit.T / 0.1  # [n, 4, 10] cosine, temperature 0.1
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), digits.flatten())
            loss = loss + (f - targets[digits]).pow(2).mean()  # and the embeddings' scale
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            pixels, digits = batch(256, "test")
            nearest = torch.cdist(features(pixels).flatten(0, 1), targets).argmin(-1)
    return float((nearest == digits.flatten()).float().mean())
