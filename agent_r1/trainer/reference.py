"""The reference policy of the KL term: the starting weights, kept frozen."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch

from agent_r1.distributed import fsdp


def reference_policy(policy: torch.nn.Module, kl_coef: float, lora: bool, sharded: bool = False) -> Callable | None:
    """A context manager factory yielding the reference policy, or None when KL is off.

    With LoRA the reference is the same model with its adapters disabled (no second copy); with
    full fine-tuning it is a frozen copy of the initial weights, `sharded` by FSDP2 like the policy
    under torchrun (make it before the policy is sharded).
    """
    if kl_coef == 0:
        return None
    if lora:

        @contextlib.contextmanager
        def adapters_off():
            with policy.disable_adapter():
                yield policy

        return adapters_off
    frozen = copy.deepcopy(policy).eval().requires_grad_(False)
    if sharded:
        fsdp.shard(frozen)
    return lambda: contextlib.nullcontext(frozen)
