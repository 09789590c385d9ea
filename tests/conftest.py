"""Shared fixtures: the real tokenizer (no network) and a tiny random-initialised model."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch
from hypothesis import settings
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from agent_r1.engines.cpu.decode_attention import kernel_for
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.models import resolve_model_path
from agent_r1.models.onednn import use_onednn
from agent_r1.utils.malloc import freeze_imported

# Property-based (fuzz) tests, the `*_fuzz.py` files. By default they run a fixed, derandomized set of
# examples, so CI sees the same inputs every run and never flakes. `HYPOTHESIS_PROFILE=long` draws fresh
# random inputs every run and 10x as many of them (~5 min), e.g. to fuzz for longer before a release:
#   HYPOTHESIS_PROFILE=long .venv/bin/pytest tests -k fuzz --hypothesis-show-statistics
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("long", derandomize=False, database=None, deadline=None, print_blob=True)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


def _split_threads() -> None:
    """Under pytest-xdist (`make test`), each worker gets its share of the cores for torch, so two workers
    on two cores do not each run two threads and slow each other several-fold (torch's OpenMP spins)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


_split_threads()


def pytest_collection_finish(session) -> None:
    """What collection imported (every test module, torch, transformers) stays out of the cyclic
    collector's walks, as `agent-r1` keeps its imports (utils/malloc.freeze_imported): each
    `release_memory` of an in-process run otherwise walks them all."""
    freeze_imported()


@pytest.fixture(scope="session", autouse=True)
def decode_attention_kernel() -> None:
    """Build the CPU decode-attention kernel before any test decodes: ~30 s once per machine, a fraction of
    a second to load after. A build inside a test, or inside a server a test started, would count against
    that test's timeouts. (tests/engines/cpu/test_decode_attention.py checks that it builds.)"""
    kernel_for(torch.float32, torch.device("cpu"))


def examples(n: int) -> int:
    """`max_examples` of a fuzz test: n by default, 10 * n under HYPOTHESIS_PROFILE=long."""
    return n * (10 if HYPOTHESIS_PROFILE == "long" else 1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test but the `gpu` ones runs on the CPU, also on a machine with a GPU. Under `device=auto`
    the trainer would move the suite's CPU-built models to CUDA, where its checks compare tensors across
    devices and expect the CPU's bit-for-bit results (on an H200, 18 of them failed and 4 errored). The CUDA
    path has its own tests (tests/test_gpu.py). Patched around the whole protocol, so the module fixtures
    a test sets up (servers, torchrun launches: `CUDA_VISIBLE_DEVICES`) see no GPU either."""
    if item.get_closest_marker("gpu") is not None:
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        return (yield)


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer from the bundled model (converted once into the cache)."""
    return AutoTokenizer.from_pretrained(resolve_model_path("default"))


def make_tiny_llama(vocab_size: int, hidden: int = 64, eos: int = 2, pad: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights: fast, deterministic, exercises GQA, RoPE and the KV cache.
    Its linear layers run on oneDNN where available, like every model `load_model` returns."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    model = LlamaForCausalLM(config).eval()
    use_onednn(model)
    return model


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)


@pytest.fixture
def engine(tiny_model, tokenizer):
    return LocalEngine(tiny_model, tokenizer, seed=0, max_context=1024)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """A tiny random Llama with the real tokenizer, saved as a Hugging Face directory (for the CLI)."""
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_llama(len(tokenizer), hidden=32, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id).save_pretrained(
        out
    )
    tokenizer.save_pretrained(out)
    return out


def recompute_logprobs(model, input_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of every token given its prefix, from one plain forward pass: [T-1]. Computed as
    z - logsumexp(z), as the trainer does (torch's fp32 log_softmax is ~1e-5 off on AVX-512 CPUs)."""
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float() / temperature  # [T-1, V]
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1)


TOOL_QUESTION = "What is 6 * 7?"
TOOL_ANSWER = "The answer is 42."


@pytest.fixture(scope="session")
def tool_model_dir(tokenizer, tmp_path_factory):
    """A tiny Llama overfit, in a few seconds, on one real calculator episode rendered exactly as
    `ToolEnv` renders it: asked TOOL_QUESTION with the calculator tool, it really writes the call,
    then (after the real tool result) TOOL_ANSWER. Chat and server tests thus see genuine tool calls."""
    import asyncio

    from agent_r1.env.prompt_format import ChatFormat
    from agent_r1.env.tool_calls import format_tool_call
    from agent_r1.env.tool_env import ToolEnv
    from agent_r1.tools import calculator
    from agent_r1.types import Action

    env = ToolEnv({"calculator": calculator}, ChatFormat(tokenizer))
    prompt = asyncio.run(env.reset({"question": TOOL_QUESTION})).token_ids
    call_text = format_tool_call("calculator", {"expression": "6 * 7"})
    call = tokenizer.encode(call_text, add_special_tokens=False)
    obs, *_ = asyncio.run(env.step(Action(call, [0.0] * len(call), call_text, "stop")))
    answer = [*tokenizer.encode(TOOL_ANSWER, add_special_tokens=False), tokenizer.eos_token_id]
    ids = torch.tensor([obs.token_ids + answer])  # [1, T]
    trained = torch.zeros_like(ids, dtype=torch.bool)  # the sampled tokens: the call and the answer
    trained[0, len(prompt) : len(prompt) + len(call)] = True
    trained[0, -len(answer) :] = True

    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=1).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    targets = ids[0, 1:][trained[0, 1:]]  # [K]
    for _ in range(200):
        hidden = model.model(ids).last_hidden_state[0, :-1][trained[0, 1:]]  # [K, H]: the vocab head runs on K rows
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    out = tmp_path_factory.mktemp("tool_model")
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@contextlib.contextmanager
def serving(app):
    """Run an ASGI app with uvicorn on a free loopback port in a thread; yield its base URL."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def tiny_llava(tokenizer):
    """A tiny LLaVA (the 2-layer random Llama + a random SigLIP tower) and its locally built processor:
    16x16 pictures, 8x8 patches, so each image is 4 placeholder ids."""
    from agent_r1.models.llava import build_llava

    lm = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    model, processor = build_llava(lm, tokenizer, image_size=16, patch_size=8)
    use_onednn(model)
    return model, processor


def picture(seed: int, size: tuple[int, int] = (20, 24)):
    """A random RGB picture (uint8 [H, W, 3]); equal seeds give equal pixels."""
    import numpy as np

    return (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")


QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def save_tiny_qwen_vl(tokenizer, out, family: str = "qwen2_vl"):
    """A tiny random Qwen2-VL or Qwen2.5-VL (mrope, a 1-block vision tower, 2x2 patch merging) with its
    processor (images only: there is no torchvision here), saved as a Hugging Face directory in `out`, to
    be loaded back with `load_model` / `load_processor` as a real one would be."""
    import copy

    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from agent_r1.models.llava import chatml_parts_template
    from agent_r1.models.loading import QWEN_VL, image_only_qwen_vl_processor

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"extra_special_tokens": list(QWEN_VL_TOKENS)}, replace_extra_special_tokens=False)
    start, end, image, video = (tok.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS)
    text = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    if family == "qwen2_vl":
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2)
    else:
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(
            depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=14,
            spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
        )  # fmt: skip
    config = config_cls(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    torch.manual_seed(0)
    model_cls(config).eval().save_pretrained(out)
    processor = image_only_qwen_vl_processor(getattr(transformers, QWEN_VL[family]))(
        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56),
        tok,
        chat_template=chatml_parts_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )
    processor.save_pretrained(out)
    return out


def save_tiny_smolvlm(tokenizer, out):
    """A tiny random SmolVLM (SigLIP-like tower, pixel-shuffle connector, Llama text model) with an
    Idefics3 processor (SmolVLM's own needs torchvision and num2words, which this install lacks; the two
    expand an image alike without image splitting): 32x32 pictures, 4 placeholders each."""
    import copy

    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from agent_r1.models.llava import chatml_parts_template

    tok = copy.deepcopy(tokenizer)
    extra = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tok.add_special_tokens({"extra_special_tokens": extra}, replace_extra_special_tokens=False)
    text = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = transformers.SmolVLMConfig(
        text_config=text, vision_config=vision, image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2
    )
    torch.manual_seed(0)
    transformers.SmolVLMForConditionalGeneration(config).eval().save_pretrained(out)
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}
    )
    transformers.Idefics3Processor(
        images, tok, image_seq_len=4, chat_template=chatml_parts_template("<image>")
    ).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_vlm(tokenizer, tmp_path_factory):
    """family -> a tiny Qwen2-VL, Qwen2.5-VL or SmolVLM and its processor, loaded from its directory (once)."""
    from agent_r1.models.loading import load_model, load_processor

    @functools.cache
    def load(family: str):
        out = tmp_path_factory.mktemp(family)
        if family == "smolvlm":
            save_tiny_smolvlm(tokenizer, out)
        else:
            save_tiny_qwen_vl(tokenizer, out, family)
        return load_model(str(out))[0], load_processor(str(out))

    return load


def record_kernel_segments(monkeypatch) -> list[bool]:
    """For each `Segment` the engine builds from now on, whether it is the CPU kernel's (built with slot_of)."""
    from agent_r1.engines.cpu import local_engine

    kinds, segment = [], local_engine.Segment

    def recorded(*args):
        kinds.append(len(args) == 8)
        return segment(*args)

    monkeypatch.setattr(local_engine, "Segment", recorded)
    return kinds


@contextlib.contextmanager
def recorded_passes():
    """Spy on every `LocalEngine` forward pass from now on, in order (filled as they run), as (rows decoding
    a token, the token counts of the prompt chunks prefilled beside them): the engine's own view, whichever
    attention (the CPU kernel's one call, or SDPA's segments) then runs it."""
    calls: list[tuple[int, tuple[int, ...]]] = []
    forward = LocalEngine._forward

    def spy(self, rows, chunks):
        calls.append((len(rows), tuple(k for _, k in chunks)))
        return forward(self, rows, chunks)

    LocalEngine._forward = spy
    try:
        yield calls
    finally:
        LocalEngine._forward = forward
