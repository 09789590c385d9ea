"""Pieces shared by the RL and SFT entry points: the model trained, the optimizer and the learning-rate
schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from agent_r1.models.loading import load_model, load_processor, place_model
from agent_r1.models.lora import with_lora


def trained_model(cfg: Any, model: torch.nn.Module | None, tokenizer: Any) -> tuple[torch.nn.Module, Any, Any, Any]:
    """(the model, its processor, its tokenizer, the policy): the config's model or the one passed in, on
    the config's device and precision with its kernels; a vision-language model's processor (what formats
    and exports take) differs from its tokenizer; the policy is the model, LoRA-wrapped with lora.enabled."""
    if model is None:
        model, tokenizer = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, training=True)
        tokenizer = load_processor(cfg.model) or tokenizer
    processor, tokenizer = tokenizer, getattr(tokenizer, "tokenizer", tokenizer)
    place_model(model, cfg.device, cfg.dtype)
    return model, processor, tokenizer, with_lora(model, cfg.lora) if cfg.lora.enabled else model


def adamw(params: list, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW with PyTorch's fused kernel where it exists (CPU and CUDA): one pass over each tensor
    instead of ~10, 4x faster on SmolLM2-135M here (0.13 s -> 0.03 s per step), the same update.
    `params`: parameters, or param groups (dicts with their own "lr")."""
    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = all(p.device.type in ("cpu", "cuda") for p in flat)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def lr_schedule(total: int, warmup: int, kind: str) -> Callable[[int], float]:
    """LR multiplier per optimizer step: linear warm-up, then constant, linear or cosine decay to 0."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        frac = min(1.0, (i - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - frac
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0

    return factor
