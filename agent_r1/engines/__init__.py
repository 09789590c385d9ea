"""Engines: what samples tokens for the agent loop, behind one protocol (`protocol.Engine`).

- `cpu/`: the CPU engine, `LocalEngine` (continuous batching in this process, a slot of keys per
  sequence, a C++ decode-attention kernel); on a GPU it runs the same code on CUDA.
- `vllm_engine.py`: vLLM's Python API in this process.
- `remote_engine.py`: any OpenAI-compatible server over HTTP (vLLM, SGLang, `agent-r1 serve`).

Callers outside this package use the protocol and the names exported here; nothing outside it imports an
engine's internals (import-linter contracts in pyproject.toml).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from agent_r1.engines.protocol import Engine

EngineKind = Literal["local", "vllm", "remote"]


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = 0.3
    """share of GPU memory vLLM may take (weights + KV cache); unused on a CPU, where kv_cache_gb rules"""
    kv_cache_gb: float | None = None
    """vLLM's KV cache in GiB; None = what gpu_memory_utilization leaves on a GPU, 4 GiB on a CPU (where
    vLLM would count the whole trainer process against gpu_memory_utilization of the RAM)"""
    enforce_eager: bool = True
    """no CUDA graphs / torch.compile: starts in seconds; set false on a GPU for faster decoding"""
    sleep: bool = True
    """on a GPU, free vLLM's memory during the update (vLLM's sleep mode) and wake it for the rollout"""
    seed_requests: bool | None = None
    """a seed on every request (seed + trajectory + turn); None = on a CPU only. On a GPU a seeded request
    takes vLLM's per-request sampling path at every step, and batches are not reproducible anyway"""


@dataclass(frozen=True)
class EngineSpec:
    """Which engine to build and its sizes, as each entry point's config states them in its own keys
    (`rollout.engine`, `rollout.kv_cache_gb` in train; `engine`, `kv_cache_gb` in eval and chat; ...)."""

    kind: EngineKind = "local"
    url: str = ""  # remote: the server's base URL
    max_batch_size: int = 64  # rows decoded together (vLLM: max_num_seqs)
    kv_cache_gb: float = 4.0  # local: KV memory
    max_prefill_tokens: int = 2048  # local: prompt tokens a forward pass prefills beside the decoding rows
    max_context: int | None = None  # None: the model's own
    kv_cache_bf16: bool = False  # local: keys and values held in bf16
    batch_wait_s: float = 0.002  # local: how long an idle engine waits for concurrent callers
    pack_weights: bool = False  # local: oneDNN-packed weights (a server's choice: faster decode, more memory)
    seed: int = 0
    dtype: str = "fp32"  # vllm: the weights' and compute dtype
    sleep: bool = False  # vllm: sleep mode (on a GPU, its memory freed during the update)
    sync_dir: str | None = None  # remote: where weight pushes are written for the server to read
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def __post_init__(self) -> None:
        if self.kind not in ("local", "vllm", "remote"):
            raise ValueError(f"engine must be local, vllm or remote, got {self.kind!r}")
        if self.kind == "remote" and not self.url:
            raise ValueError("a remote engine needs url (the server's base URL, http://host:port)")


def make_engine(spec: EngineSpec, model: Any, tokenizer: Any = None) -> Engine:
    """The one place engines are built (train, eval, chat, serve, Ray workers). `model` is what the engine
    samples from: a loaded model for `local` (used as it is, no copy), a Hugging Face directory for
    `vllm`; a `remote` engine samples from the server's. Engine modules are imported here, on use: vLLM and
    the CPU kernel's build are only paid for by the engine chosen."""
    if spec.kind == "remote":
        from agent_r1.engines.remote_engine import RemoteEngine

        return RemoteEngine(spec.url, max_context=spec.max_context, sync_dir=spec.sync_dir)
    if spec.kind == "vllm":
        from agent_r1.engines.vllm_engine import VLLMEngine
        from agent_r1.models.precision import TORCH_DTYPES

        v = spec.vllm
        return VLLMEngine(
            str(model), dtype=TORCH_DTYPES[spec.dtype], max_context=spec.max_context, seed=spec.seed,
            gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager, sleep=spec.sleep,
            max_num_seqs=spec.max_batch_size, kv_cache_gb=v.kv_cache_gb, seed_requests=v.seed_requests,
        )  # fmt: skip
    import torch

    from agent_r1.engines.cpu.local_engine import LocalEngine

    return LocalEngine(
        model, tokenizer, max_batch_size=spec.max_batch_size, max_context=spec.max_context, seed=spec.seed,
        batch_wait_s=spec.batch_wait_s, kv_cache_gb=spec.kv_cache_gb, max_prefill_tokens=spec.max_prefill_tokens,
        pack_weights=spec.pack_weights, kv_cache_dtype=torch.bfloat16 if spec.kv_cache_bf16 else None,
    )  # fmt: skip


def check_installed(kind: EngineKind) -> None:
    """Fail with one line saying how to install the engine's package, before any model loads."""
    if kind == "vllm":
        from agent_r1.engines.vllm_engine import import_vllm

        import_vllm()


def load_for_engine(kind: EngineKind, name_or_path: str, device: str = "auto", dtype: str = "fp32") -> tuple[Any, Any]:
    """(what `make_engine` samples from, the tokenizer): the loaded model for `local`; for `vllm` and `remote`
    only its directory (a bundled model converted once) and tokenizer, with no weights loaded here: vLLM
    loads its own, and a server's model is the server's."""
    from agent_r1.models.loading import load_model, resolve_model_path

    check_installed(kind)
    if kind == "local":
        return load_model(name_or_path, device=device, dtype=dtype)
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    return str(path), AutoTokenizer.from_pretrained(path)
