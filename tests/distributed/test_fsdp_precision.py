"""FSDP2 under dtype=bf16, in this process (a gloo group of one): each decoder layer is gathered and computes
in bf16 through FSDP2's mixed-precision policy with no autocast on top, the root (the LM head) stays fp32, and
the gradients land in fp32 master shards."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agent_r1.distributed import fsdp
from agent_r1.models.precision import set_precision
from agent_r1.trainer.batching import pack, token_logprobs
from tests.conftest import make_tiny_llama
from tests.models.test_precision import rows


def test_bf16_layers_gather_and_compute_in_bf16_the_head_in_fp32_and_gradients_are_fp32(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = set_precision(make_tiny_llama(64, hidden=32), "bf16")
        fsdp.shard(model)
        seen = {}

        def record(name):
            def hook(module, args, out):
                seen[name] = (module.weight.dtype, args[0].dtype, out.dtype, torch.is_autocast_enabled("cpu"))

            return hook

        model.model.layers[0].mlp.down_proj.register_forward_hook(record("layer"))
        model.lm_head.register_forward_hook(record("head"))
        (mb,) = pack(rows(), 256, min_shared_prefix=100)
        logp = token_logprobs(model, mb)[0]
        (logp * mb.mask).sum().backward()
        # a layer's gathered weights are bf16 (half the all-gather bytes), it computes in bf16, and no autocast
        # runs on top (whose cast copies of every layer's weights would live until the backward)
        assert seen["layer"] == (torch.bfloat16, torch.bfloat16, torch.bfloat16, False)
        assert seen["head"][0] == torch.float32 and seen["head"][2] == torch.float32  # fp32 logits
        assert logp.dtype == torch.float32
        for name, p in model.named_parameters():  # fp32 master shards, fp32 gradients (reduced in fp32)
            assert isinstance(p, DTensor) and p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        assert float(model.model.layers[0].mlp.down_proj.weight.grad.norm()) > 0
    finally:
        dist.destroy_process_group()
