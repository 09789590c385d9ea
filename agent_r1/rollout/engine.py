"""The one interface every inference backend implements.

The agent loop only ever calls `await engine.generate(prompts, params)`, so it neither knows nor cares
whether the model lives in this process (`LocalEngine`), in a Ray actor or behind an HTTP server.
Token ids in, token ids + log-probs out: text is derived, never the source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response. Requests with equal params can share one batch."""

    max_new_tokens: int = 256  # upper bound on sampled tokens per response
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass; 1.0 disables it
    stop: tuple[str, ...] = ()  # generation ends once the decoded response contains one of these
    seed: int | None = None  # seeds this call's sampling; None continues the engine's own stream

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerateOutput:
    """One sampled response.

    `logprobs` are log-softmax of logits / temperature (temperature 1 when greedy), before top-p
    truncation: the quantity the trainer recomputes for the importance ratio, as in verl.
    """

    token_ids: list[int]  # [R]
    logprobs: list[float]  # [R]
    text: str
    finish_reason: str  # "stop" | "eos" | "length"
    prompt_len: int = 0


class Engine(Protocol):
    """Batched async generation over token ids."""

    max_context: int  # prompt + response tokens the model can attend to

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerateOutput]:
        """Sample one response per prompt."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from `model`'s current weights (the trainer calls it once per RL step)."""
        ...


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights under the plain model's names, what an engine serving the plain model loads.

    For a peft LoRA model the active adapters are merged in: each LoRA layer's base weight (and bias)
    is merged by peft's own `merge()` into a copy, so the result equals `merge_and_unload()`'s state
    dict bit for bit, and `model` is left untouched (merging and unmerging in place would drift the
    base weights by rounding at every sync). The adapters' own tensors are dropped, `base_layer.` is
    removed from names. Unmerged tensors are the model's own (no copy); tied weights stay aliased.
    """
    if not hasattr(model, "get_base_model"):  # not a peft model
        return model.state_dict()
    import torch
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = base.state_dict()
    for path, layer in base.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        prefix = f"{path}."
        for name in [k for k in state if k.startswith(prefix) and not k.startswith(f"{prefix}base_layer.")]:
            del state[name]  # lora_A, lora_B, ...: folded into the base weight below
        if layer.disable_adapters or not set(layer.active_adapters) - set(layer.merged_adapters):
            continue  # the base weight is already what the layer computes with
        params = [(n, p) for n, p in layer.named_parameters() if n.startswith("base_layer.")]
        originals, merged_before = [p.data for _, p in params], list(layer.merged_adapters)
        try:
            for _, p in params:
                p.data = p.data.clone()
            with torch.no_grad():
                layer.merge()  # merges the active adapters not merged yet, into the clones
            state.update({prefix + n: p.data for n, p in params})
        finally:
            for (_, p), data in zip(params, originals, strict=True):
                p.data = data
            layer.merged_adapters[:] = merged_before
    names = {k: k.replace(".base_layer.", ".") for k in state}
    if leftover := next((k for k in names.values() if ".modules_to_save." in k or ".original_module." in k), None):
        raise ValueError(f"cannot sync peft modules_to_save weights ({leftover}): merge the model first")
    return {names[k]: v for k, v in state.items()}


def alias_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that are the same memory (tied weights such as embed_tokens and lm_head)."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()
