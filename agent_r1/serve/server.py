"""The typed config of `agent-r1 serve` and the uvicorn process around `create_app`."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import uvicorn

from agent_r1.engines import EngineKind, EngineSpec, VLLMConfig, load_for_engine, make_engine
from agent_r1.engines.protocol import Engine
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.env.tool_formats import ToolFormatName
from agent_r1.models.loading import DEFAULT_MODEL, eos_token_ids, is_chat_model, load_processor
from agent_r1.models.precision import Device, Precision
from agent_r1.online.record import Recorder
from agent_r1.online.store import Store
from agent_r1.serve.app import ServedModel, create_app
from agent_r1.task import resolve_tool_format
from agent_r1.utils.imports import import_path


@dataclass
class RecordConfig:
    store: str = "runs/online/store.db"
    """the interaction store: a SQLite file, or a PostgreSQL URL (postgresql://user@host/db) shared by servers"""
    sync: Literal["normal", "full"] = "normal"
    """SQLite: normal survives a killed process, full also a power cut (an fsync per request)"""
    explore: float = 0.0
    """share of plain requests (n=1, not streamed) that sample explore_n answers, serve one and store all"""
    explore_n: int = 4
    """answers an explored request samples (a GRPO group, scored by the judge)"""
    redact: str = ""
    """import path of a function text -> text applied to every message and answer before storage"""


@dataclass
class ServeConfig:
    model: str = "default"
    """"default", a bundled model name, a Hugging Face directory or an `agent-r1 export` directory"""
    device: Device = "auto"
    """where the model runs: auto = cuda when a GPU is visible, else cpu"""
    dtype: Precision = "fp32"
    """weights and compute in fp32, or in bf16 (a GPU choice: half the memory)"""
    engine: EngineKind = "local"
    """what samples: local (the CPU engine in this process, or the same code on a GPU), vllm (vLLM in this
    process), or remote (another OpenAI-compatible server that speaks token ids at url, which this one fronts
    with model's tokenizer and prompt format)"""
    url: str = ""
    """engine=remote: that server's base URL (http://host:port)"""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """engine=vllm: vLLM's own settings"""
    name: str | None = None
    """the model id clients send as "model"; None = the model's name (directory name for a path)"""
    host: str = "127.0.0.1"
    """interface to listen on (0.0.0.0 exposes the server to the network)"""
    port: int = 8000
    """port to listen on; 0 picks a free one (the address is printed)"""
    max_batch_size: int = 64
    """requests decoded together by the engine"""
    max_context: int | None = None
    """prompt + completion tokens per request; None = the model's max_position_embeddings"""
    max_tokens: int = 512
    """completion tokens of a chat request that sets no max_tokens"""
    request_timeout: float = 300.0
    """seconds before a request is cancelled (504)"""
    batch_wait_ms: float = 2.0
    """how long an idle engine waits for more requests to arrive and be prefilled together"""
    kv_cache_gb: float = 4.0
    """KV memory for running requests and for finished ones kept for a continuation (evicted first);
    requests wait for room rather than exceed it; at most half the memory free at start-up"""
    kv_cache_dtype: Literal["auto", "bf16"] = "auto"
    """keys and values as the model computes them (auto), or in bf16 for an fp32 model: twice the tokens in
    kv_cache_gb and, on the CPU, fewer bytes for each decode step to read, at bf16's rounding of them
    (vLLM's kv_cache_dtype)"""
    max_prefill_tokens: int = 2048
    """prompt tokens one forward pass prefills beside the decoding rows (chunked prefill): lower keeps the
    answers already streaming smooth while a burst arrives, higher prefills the burst sooner"""
    seed: int = 0
    """seed of requests that set none"""
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    """chat template or plain text; auto = chat when the model has a template"""
    tool_format: ToolFormatName = "auto"
    """how the model writes tool calls: auto = what it was trained with (its agent_r1.json), else its chat
    template's family (hermes, llama3_json, mistral, mistral_args, qwen3_coder, harmony)"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """uvicorn log level"""
    max_request_mb: float = 8.0
    """largest request body in MiB; a larger one is refused with a 413 before it is read into memory"""
    allow_weight_updates: bool = False
    """accept POST /v1/load_weights (a trainer's rollout server, rollout.engine=remote): any client that
    reaches the server can then replace its weights"""
    learn: bool = False
    """learn from use (docs/online.md): commit every chat request to `online.store` before answering it, take
    feedback at /v1/feedback, start on the store's serving version and take `agent-r1 learn`'s new ones
    (implies allow_weight_updates)"""
    online: RecordConfig = field(default_factory=RecordConfig)
    """learn=true: the interaction store, exploration and redaction"""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        sizes = (self.max_batch_size, self.max_tokens, self.request_timeout, self.max_request_mb, self.kv_cache_gb)
        if min(*sizes, self.max_prefill_tokens) <= 0:
            raise ValueError(
                "max_batch_size, max_tokens, request_timeout, max_request_mb, kv_cache_gb and max_prefill_tokens "
                "must be positive"
            )
        self.engine_spec()  # an unknown engine, or remote without url: one line now
        if not 0 <= self.online.explore <= 1 or self.online.explore_n < 2:
            raise ValueError("online.explore must be in [0, 1] and online.explore_n >= 2")

    def engine_spec(self) -> EngineSpec:
        return EngineSpec(
            self.engine, self.url, self.max_batch_size, self.kv_cache_gb, self.max_prefill_tokens, self.max_context,
            self.kv_cache_dtype == "bf16", self.batch_wait_ms / 1000,
            pack_weights=True,  # a server holds no trainer: its memory can take the weights' oneDNN copies
            seed=self.seed, dtype=self.dtype, vllm=self.vllm,
        )  # fmt: skip

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        return DEFAULT_MODEL if self.model == "default" else Path(self.model).name or self.model


def run_serve(cfg: ServeConfig) -> None:
    """Load the model, bind the socket (so port=0 can print its real port), serve until Ctrl-C."""
    model, tokenizer = load_for_engine(cfg.engine, cfg.model, cfg.device, cfg.dtype)
    processor = load_processor(cfg.model) or tokenizer  # a vision-language model reads image_url parts through it
    chat = is_chat_model(cfg.model, processor) if cfg.prompt_format == "auto" else cfg.prompt_format == "chat"
    engine = make_engine(cfg.engine_spec(), model, tokenizer)
    recorder = _recorder(cfg, engine) if cfg.learn else None
    served = ServedModel(
        engine, tokenizer, prompt_format_for(processor, chat, resolve_tool_format(cfg.tool_format, cfg.model)),
        cfg.served_name, eos_token_ids(model, tokenizer),
        request_timeout=cfg.request_timeout, default_max_tokens=cfg.max_tokens, max_batch_size=cfg.max_batch_size,
        allow_weight_updates=cfg.allow_weight_updates or cfg.learn, max_request_bytes=int(cfg.max_request_mb * 2**20),
        recorder=recorder,
    )  # fmt: skip
    sock = socket.create_server((cfg.host, cfg.port), reuse_port=False)
    host, port = sock.getsockname()[:2]
    print(f"agent-r1 serve: {served.name} at http://{host}:{port}/v1", flush=True)
    config = uvicorn.Config(create_app(served), log_level=cfg.log_level, timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()
        if recorder is not None:
            recorder.store.close()


def _recorder(cfg: ServeConfig, engine: Engine) -> Recorder:
    """The store's recorder; the engine first takes the version the store says is serving (the last one
    promoted or rolled back to), so a restarted server comes back on it."""
    from safetensors.torch import load_file

    store = Store(cfg.online.store, sync=cfg.online.sync)
    redact = import_path(cfg.online.redact, "online.redact") if cfg.online.redact else None
    serving = store.serving()
    if serving is not None and serving.path:
        engine.load_weights(load_file(serving.path), serving.version)
        print(f"agent-r1 serve: weights version {serving.version} from {serving.path}", flush=True)
    return Recorder(store, explore=cfg.online.explore, explore_n=cfg.online.explore_n, redact=redact, seed=cfg.seed)
