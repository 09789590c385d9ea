"""One torchrun rank with an in-process vLLM engine on a GPU (tests/test_gpu.py): joins the NCCL group as the
trainer does, starts the engine, samples, and writes which GPU its engine and its current device are on."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch

from agent_r1.distributed.group import init_distributed
from agent_r1.engines.protocol import SamplingParams
from agent_r1.engines.vllm_engine import VLLMEngine
from agent_r1.models.loading import resolve_model_path

if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist = init_distributed("cuda")
    model = resolve_model_path("default")
    engine = VLLMEngine(model, dtype=torch.bfloat16, max_context=512, gpu_memory_utilization=0.3)
    sample = asyncio.run(engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=8, temperature=1.0)))[0]
    dist.barrier()  # an NCCL collective after vLLM started: two ranks on one GPU would hang or fail here
    report = {
        "rank": dist.rank, "current_device": torch.cuda.current_device(), "engine_device": engine._device,
        "sampled_tokens": len(sample.token_ids),
    }  # fmt: skip
    (out / f"rank{dist.rank}.json").write_text(json.dumps(report))
    engine.close()
    dist.close()
