"""LoRA adapters through peft (Hu et al. 2021, arXiv 2106.09685)."""

from __future__ import annotations

import torch

from agent_r1.trainer.config import LoraConfig


def with_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Wrap `model` with trainable LoRA adapters; the base weights are frozen.

    The base model with adapters disabled (`disable_adapter()`) is the RL reference policy for free.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
    )
    return get_peft_model(model, config)
