"""FSDP2 in this process (a gloo group of one). Under dtype=bf16 each decoder layer is gathered and computes in
bf16 through FSDP2's mixed-precision policy with no autocast on top, the root (the LM head) stays fp32, and the
gradients land in fp32 master shards. The weight sync gathers one tensor at a time into an unsharded copy that
lives on the CPU when vLLM or a server samples."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agent_r1.distributed import fsdp
from agent_r1.models.precision import set_precision
from agent_r1.trainer.batching import pack, token_logprobs
from tests.conftest import make_tiny_llama
from tests.models.test_precision import rows


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bf16_layers_gather_and_compute_in_bf16_the_head_in_fp32_and_gradients_are_fp32(gloo):
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


def test_the_weight_sync_gathers_one_tensor_at_a_time_into_the_unsharded_copy(gloo, monkeypatch):
    sharded = make_tiny_llama(64, hidden=32)
    plain = copy.deepcopy(sharded)
    fsdp.shard(sharded)
    with torch.no_grad():
        for p in sharded.parameters():
            p.add_(1.0)  # the update: the copy must follow
    alive, calls, gather = [], [], DTensor.full_tensor

    def full_tensor(self, **kwargs):
        calls.append(sum(r() is not None for r in alive))  # gathered tensors still held when this one starts
        out = gather(self, **kwargs)
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(DTensor, "full_tensor", full_tensor)
    fsdp.copy_full_weights(sharded, plain)
    assert len(calls) == len(plain.state_dict()) and max(calls) <= 1  # never more than the one just copied
    for name, t in plain.state_dict().items():
        assert torch.equal(t, sharded.state_dict()[name].full_tensor()), name


@pytest.mark.parametrize(("overrides", "on_cpu"), [([], False), (["rollout.engine=vllm"], True)])
def test_under_torchrun_the_unsharded_copy_is_on_the_cpu_when_vllm_samples(overrides, on_cpu):
    from agent_r1.config import load_config
    from agent_r1.trainer.config import TrainConfig
    from agent_r1.trainer.setup import _unsharded_copy
    from tests.models.test_precision import no_tensor_deepcopy

    cfg = load_config(TrainConfig, None, overrides)
    model = make_tiny_llama(64, hidden=32)
    if on_cpu:
        with no_tensor_deepcopy():  # each tensor copied to the CPU, none cloned on the policy's GPU
            plain = _unsharded_copy(cfg, model)
    else:
        plain = _unsharded_copy(cfg, model)  # the local engine decodes over it: the policy's device
    assert plain is not model and all(p.device == torch.device("cpu") for p in plain.parameters())


def test_a_separate_critic_is_sharded_in_its_backbones_precision(gloo):
    from agent_r1.trainer.critic import Critic

    critic = Critic(set_precision(make_tiny_llama(64, hidden=32), "bf16"), "separate")
    fsdp.shard(critic)
    seen = []
    layer = critic.backbone.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, torch.is_autocast_enabled("cpu"))))
    (mb,) = pack(rows(), 256, min_shared_prefix=100)
    critic(mb, None)  # its forward enters the backbone's autocast: none any more, the policy casts
    assert seen == [(torch.bfloat16, False)]


def test_a_vlm_shards_its_language_models_layers_not_only_the_longer_vision_tower(gloo):
    """Qwen2-VL's vision tower has more blocks (32) than its language model has layers (28): taking the
    longest ModuleList left the whole language model unsharded on every rank."""
    import transformers
    from torch.distributed.fsdp import FSDPModule

    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]},
    )  # fmt: skip
    vision = dict(depth=3, embed_dim=16, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2)
    model = transformers.Qwen2VLForConditionalGeneration(
        transformers.Qwen2VLConfig(text_config=text, vision_config=vision)
    )
    fsdp.shard(model)
    layers, blocks = model.model.language_model.layers, model.model.visual.blocks
    assert len(blocks) > len(layers)
    assert all(isinstance(m, FSDPModule) for m in [*layers, *blocks])
    assert not any(isinstance(m, FSDPModule) for m in layers[0].modules() if m is not layers[0])  # outermost only
