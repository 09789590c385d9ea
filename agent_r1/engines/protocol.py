"""The one interface every inference backend implements.

The agent loop calls `await engine.generate(prompts, params)`, so it neither knows nor cares whether the
model lives in this process (`LocalEngine`), in vLLM, in a Ray actor or behind an HTTP server.
Token ids in, token ids + log-probs out: text is derived, never the source of truth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agent_r1.models.lora import merged_copy

if TYPE_CHECKING:
    import torch

# The attention implementation a CPU engine's model runs with: registered by `cpu/kv_cache.py`, it computes
# as SDPA for every forward pass but the engine's own, so the trainer's forward treats it as SDPA.
SLOT_ATTENTION = "agent_r1_slots"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response. Requests with equal params can share one batch."""

    max_new_tokens: int = 256  # upper bound on sampled tokens per response
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass; 1.0 disables it
    stop: tuple[str, ...] = ()  # generation ends once the decoded response contains one of these
    seed: int | None = None  # seeds this call's sampling; None continues the engine's own stream
    # EBNF (xgrammar's dialect, vLLM's `structured_outputs.grammar`) the response must match: tokens it does
    # not allow next get logit -inf, so log-probs are over the allowed tokens (agent_r1/models/grammar.py)
    grammar: str | None = None

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


TokenCallback = Callable[[int, int, float], Any]  # on_token(prompt index, token id, log-prob)


class Engine(Protocol):
    """What every engine offers, and all that callers use: the agent loop, the trainer, eval, chat and
    serve hold an `Engine` and call these, never an engine's own methods found by probing.

    `make_engine` (agent_r1/engines/__init__.py) builds one from a config: `LocalEngine` (this process, CPU
    or GPU), `VLLMEngine` (vLLM in this process) or `RemoteEngine` (an OpenAI-compatible server)."""

    max_context: int  # prompt + response tokens the model can attend to
    weights_version: int  # bumped by every load_weights (and every sync); sampled tokens carry it
    stats: dict[str, float]  # what the engine counts (LocalEngine: seconds in forward passes, ...); {} if none

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_token: TokenCallback | None = None,
        *,
        images: list[list[Any]] | None = None,
    ) -> list[GenerateOutput]:
        """Sample one response per prompt. `on_token(i, token, logprob)` sees prompt i's tokens in order
        before the call returns: as they are decoded (LocalEngine), or all at the end (an engine that does not
        stream). `images[i]`: the images of prompt i's placeholders (engines that read images)."""
        ...

    def cohort(self, size: int) -> contextlib.AbstractContextManager[Any]:
        """`size` callers that take turns (the agent loop's episodes, each `join()`ing in its task and
        `leave()`ing at its end): an engine that can batch them independently of timing does (LocalEngine)."""
        ...

    def sync_weights(self, model: torch.nn.Module, version: int | None = None, between_tokens: bool = False) -> None:
        """Sample from `model`'s current weights (LoRA merged) as `version`, as `load_weights` does (the
        trainer calls it after each update); an engine over `model` itself has nothing to copy."""
        ...

    def load_weights(
        self, state: Mapping[str, torch.Tensor], version: int | None = None, between_tokens: bool = False
    ) -> int:
        """Sample from `state` as `version` (the next one by default); with `between_tokens`, at the next token
        boundary while requests in flight go on. Returns the version now served."""
        ...

    def sleep(self) -> None:
        """Give back the memory sampling holds (KV cache; vLLM's weights on a GPU) for the update; the next
        request (or sync) takes it again. A no-op where there is nothing to give back (a server)."""
        ...

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until no request is running here; whether it went idle."""
        ...

    def close(self) -> None:
        """Stop: pending requests fail, memory and threads go. The engine is not used again."""
        ...


class _NoCohort:
    """The cohort of an engine whose batches depend on timing anyway (vLLM, a server)."""

    def join(self) -> None:
        pass

    def leave(self) -> None:
        pass


@contextlib.contextmanager
def no_cohort(size: int) -> Iterator[_NoCohort]:
    yield _NoCohort()


def replay_tokens(outs: list[GenerateOutput], on_token: TokenCallback | None) -> list[GenerateOutput]:
    """`on_token` for an engine that does not stream: every prompt's tokens, in order, once it has them."""
    if on_token is not None:
        for i, out in enumerate(outs):
            for token, logprob in zip(out.token_ids, out.logprobs, strict=True):
                on_token(i, token, logprob)
    return outs


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights under the plain model's names, what an engine serving the plain model loads:
    a peft LoRA policy's merged copy (as export writes it), else the model's own tensors (no copy)."""
    return merged_copy(model).state_dict() if hasattr(model, "merge_and_unload") else model.state_dict()


def alias_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that are the same memory (tied weights such as embed_tokens and lm_head)."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()


def engine_busy_s(engine: Engine | None) -> float | None:
    """Seconds the engine has spent in forward passes, for engines that count them (LocalEngine); None for
    one that does not, or none in this process (Ray workers)."""
    stats = engine.stats if engine is not None else {}
    return stats["prefill_s"] + stats["decode_s"] + stats["mixed_s"] if "decode_s" in stats else None
