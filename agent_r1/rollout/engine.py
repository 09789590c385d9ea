"""The one interface every inference backend implements.

The agent loop only ever calls `await engine.generate(prompts, params)`, so it neither knows nor cares
whether the model lives in this process (`LocalEngine`), in a Ray actor or behind an HTTP server.
Token ids in, token ids + log-probs out: text is derived, never the source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agent_r1.models.lora import merged_copy

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
    versions: list[int] | None = None  # [R] the policy version that sampled each token (None: not tracked)


class Engine(Protocol):
    """Batched async generation over token ids."""

    max_context: int  # prompt + response tokens the model can attend to

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerateOutput]:
        """Sample one response per prompt. An engine that reads images (LocalEngine, for a
        vision-language model) also takes `images=`: per prompt, the images of its placeholders."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from `model`'s current weights (the trainer calls it once per RL step)."""
        ...


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights under the plain model's names, what an engine serving the plain model loads:
    a peft LoRA policy's merged copy (as export writes it), else the model's own tensors (no copy)."""
    return merged_copy(model).state_dict() if hasattr(model, "merge_and_unload") else model.state_dict()


def alias_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that are the same memory (tied weights such as embed_tokens and lm_head)."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()


def engine_busy_s(engine: Any) -> float | None:
    """Seconds the engine has spent in forward passes, for engines that count them (LocalEngine)."""
    stats = getattr(engine, "stats", None)
    return stats["prefill_s"] + stats["decode_s"] + stats["mixed_s"] if stats else None
