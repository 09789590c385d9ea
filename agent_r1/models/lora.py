"""LoRA adapters through peft (Hu et al. 2021, arXiv 2106.09685)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from agent_r1.models.precision import cpu_copy


@dataclass
class LoraConfig:
    enabled: bool = False
    """train LoRA adapters (peft) instead of all weights; the reference policy is then free"""
    r: int = 16
    """adapter rank"""
    alpha: int = 32
    """adapter scaling numerator (scale = alpha / r)"""
    dropout: float = 0.0
    """dropout on the adapter input"""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """module names that get adapters"""


def merged_copy(model: torch.nn.Module, cpu: bool = False) -> torch.nn.Module:
    """A copy of the policy as a plain model: LoRA adapters folded into the weights (peft's
    `merge_and_unload`), tied weights still tied; the trainer's model is left untouched. `cpu`: the
    copy is made on the CPU, never on the model's GPU (exports, checkpoints, what Ray ships)."""
    copied = cpu_copy(model) if cpu else copy.deepcopy(model)
    return copied.merge_and_unload() if hasattr(copied, "merge_and_unload") else copied


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
