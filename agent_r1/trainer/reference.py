"""The reference policy of the KL term: the starting weights, kept frozen."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agent_r1.distributed import fsdp


def reference_policy(
    policy: torch.nn.Module, kl_coef: float, lora: bool, sharded: bool = False, offload_to: Path | None = None
) -> Callable | None:
    """A context manager factory yielding the reference policy, or None when KL is off.

    With LoRA the reference is the same model with its adapters disabled (no second copy); with
    full fine-tuning it is a frozen copy of the initial weights, `sharded` by FSDP2 like the policy
    under torchrun (make it before the policy is sharded), or, with `offload_to` (a file), held in
    memory only while it computes (`_on_disk`).
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
    if offload_to is not None and not sharded:
        return _on_disk(frozen, Path(offload_to))
    return lambda: contextlib.nullcontext(frozen)


def _on_disk(frozen: torch.nn.Module, path: Path) -> Callable:
    """The reference's weights in a safetensors file between uses, read back for each reference pass.

    The reference is used once per RL step, before the update, whose activations and gradients then
    set the process's peak memory: a whole fp32 model less at that peak (0.54 GB for the 135M demo
    model), for one read of the file per step (the demo's reference pass: 9.80 -> 9.97 s a step). The weights read
    back are the bytes written, so the log-probs are bitwise those of a reference kept in memory.
    Parameters only (buffers such as RoPE's frequencies stay); tied weights are one parameter, freed
    and restored once."""
    params = dict(frozen.named_parameters())  # [name] -> parameter; a tied weight appears once
    device = str(next(iter(params.values())).device)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().contiguous() for n, p in params.items()}, str(path))
    _free(params)

    @contextlib.contextmanager
    def loaded():
        tensors = load_file(str(path), device=device)
        for n, p in params.items():
            p.data = tensors[n]
        try:
            yield frozen
        finally:
            _free(params)

    return loaded


def _free(params: dict[str, torch.nn.Parameter]) -> None:
    """Drop the parameters' storage (a forward pass between uses fails on the empty shapes, loudly)."""
    for p in params.values():
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
