"""oneDNN linear layers: the same values and gradients as F.linear (up to fp32 rounding), in place."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM

from agent_r1.models.lora import with_lora
from agent_r1.models.onednn import (
    _PACKS,
    ONEDNN_CACHE_ENTRIES,
    LeanRMSNorm,
    OneDNNLinear,
    RecomputedSwiGLU,
    onednn_available,
    packed_weights,
    use_onednn,
)
from agent_r1.trainer.config import LoraConfig
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.skipif(not onednn_available(), reason="needs an x86 PyTorch build with oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24)], ids=["2d", "3d"])
def test_forward_and_gradients_match_f_linear(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    fast = copy.deepcopy(layer)
    assert use_onednn(fast) == 1 and type(fast) is OneDNNLinear
    x = torch.randn(shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    g = torch.randn(*shape[:-1], 40)  # an upstream gradient that is not all ones

    expected = F.linear(x, layer.weight, layer.bias)
    got = fast(x2)
    (expected * g).sum().backward()
    (got * g).sum().backward()

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.weight.grad, layer.weight.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(fast.bias.grad, layer.bias.grad, rtol=1e-5, atol=1e-5)


def test_frozen_weight_gets_no_gradient_and_inference_needs_none():
    layer = nn.Linear(8, 4)
    use_onednn(layer)
    layer.requires_grad_(False)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and x.grad is not None
    with torch.inference_mode():
        assert not layer(torch.randn(2, 8)).requires_grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(64, 576, 576), (2, 576, 1536), (300, 1536, 576), (3, 5, 96, 40)])
def test_packed_weights_give_the_plain_products_to_the_bit(bias, shape):
    """Under `packed_weights` a product of two rows or more multiplies by the weight in oneDNN's layout,
    packed once and reused, with bitwise the same result; one row keeps the plain weight (another kernel,
    other rounding); a weight changed in place is packed again; outside the context nothing is packed."""
    *rows, d_in, d_out = shape
    torch.manual_seed(0)
    layer = nn.Linear(d_in, d_out, bias=bias)
    use_onednn(layer)
    x, one = torch.randn(*rows, d_in), torch.randn(1, d_in)
    with torch.inference_mode():
        plain, plain_one = layer(x), layer(one)
        packs = {}
        with packed_weights(packs):
            assert torch.equal(layer(one), plain_one) and packs == {}  # one row: not packed
            assert torch.equal(layer(x), plain) and torch.equal(layer(x), plain)
            ((version, packed),) = packs.values()
            assert packed.layout == torch._mkldnn and version == (layer.weight._version, layer.weight.data_ptr())
            layer.weight.mul_(2)  # an update in place between passes
            assert torch.equal(layer(x), _plain(layer, x))
            assert packs[layer][1] is not packed
            with torch.inference_mode(False):
                layer.weight = nn.Parameter(layer.weight / 2)  # a new tensor, with its own version counter
            assert torch.equal(layer(x), plain)
            layer.weight = nn.Parameter(layer.weight.clone(), requires_grad=False)  # an inference tensor: no version
            assert torch.equal(layer(x), plain) and packs[layer][0][1] != layer.weight.data_ptr()  # left plain
        assert _PACKS.get() is None
        assert torch.equal(layer(x), _plain(layer, x))


def _plain(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's product with its plain weight (no pack held)."""
    token = _PACKS.set(None)
    try:
        return layer(x)
    finally:
        _PACKS.reset(token)


def test_swap_keeps_weights_state_dict_and_deepcopy():
    model = make_tiny_llama(100)  # already swapped by the fixture helper
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert n_linear == sum(type(m) is OneDNNLinear for m in model.modules()) > 0
    assert use_onednn(model) == 0  # idempotent: nothing left to swap
    plain = LlamaForCausalLM(model.config)  # never swapped: the checkpoint layout a swap must keep
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    plain.load_state_dict(model.state_dict())  # strict: every key and shape lines up both ways
    clone = copy.deepcopy(model)
    assert type(clone.lm_head) is OneDNNLinear and clone.lm_head is not model.lm_head


def test_the_whole_model_matches_mkl_in_values_and_gradients():
    torch.manual_seed(0)
    fast = make_tiny_llama(100)
    plain = copy.deepcopy(fast)
    for m in plain.modules():
        if type(m) is OneDNNLinear:
            m.__class__ = nn.Linear
    ids = torch.randint(0, 100, (2, 12))
    lp_fast = torch.log_softmax(fast(ids).logits, -1)
    lp_plain = torch.log_softmax(plain(ids).logits, -1)
    torch.testing.assert_close(lp_fast, lp_plain, rtol=1e-5, atol=1e-5)
    lp_fast[..., 3].sum().backward()
    lp_plain[..., 3].sum().backward()
    for (name, a), b in zip(fast.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_on_top_trains_only_the_adapters():
    model = make_tiny_llama(100)
    policy = with_lora(model, LoraConfig(enabled=True, r=4))
    ids = torch.randint(0, 100, (1, 10))
    policy(input_ids=ids).logits.sum().backward()
    grads = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)


def test_opting_out_keeps_mkl(monkeypatch):
    monkeypatch.setenv("AGENT_R1_ONEDNN", "0")
    layer = nn.Linear(4, 4)
    assert not onednn_available() and use_onednn(layer) == 0 and type(layer) is nn.Linear


def test_swiglu_mlps_and_rmsnorms_hold_less_with_the_same_gradients_to_the_bit():
    """Under `use_onednn` Llama's MLP holds gate and up for backward, not silu(gate) and the product
    too, and its RMSNorm holds x, not the normalised x as well; values and every gradient are bitwise
    those of autograd through the original modules."""
    torch.manual_seed(0)
    fast = make_tiny_llama(100)
    assert all(isinstance(m, RecomputedSwiGLU) for m in fast.modules() if type(m).__name__ == "LlamaMLP")
    norms = [m for m in fast.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(isinstance(m, LeanRMSNorm) for m in norms)
    with torch.no_grad():  # weights other than ones: their product is part of what must match
        for m in norms:
            m.weight.normal_(1.0, 0.2)
    plain = copy.deepcopy(fast)  # copies are of the original classes (oneDNN linears kept)
    assert not any(isinstance(m, RecomputedSwiGLU | LeanRMSNorm) for m in plain.modules())
    ids = torch.randint(0, 100, (2, 12))

    def run(model):
        held = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t.numel()) or t, lambda t: t):
            logits = model(ids).logits
        torch.log_softmax(logits, -1)[..., 3].sum().backward()
        return logits, sum(held), {n: p.grad for n, p in model.named_parameters()}

    logits, held, grads = run(fast)
    logits_plain, held_plain, grads_plain = run(plain)
    assert torch.equal(logits, logits_plain)
    assert all(torch.equal(grads[n], g) for n, g in grads_plain.items())
    cfg, layers = fast.config, fast.config.num_hidden_layers
    mlps = 2 * cfg.intermediate_size * layers  # silu(gate) and the product, a layer
    rms = (2 * layers + 1) * cfg.hidden_size  # the normalised x, two norms a layer and the final one
    assert held_plain - held == ids.numel() * (mlps + rms)


def test_the_mixins_pickle_as_the_original_classes_and_lora_falls_back():
    import pickle

    model = make_tiny_llama(100)
    back = pickle.loads(pickle.dumps(model))  # Ray ships CPU copies of the policy to its workers
    layer = back.model.layers[0]
    assert type(layer.mlp).__name__ == "LlamaMLP" and not isinstance(layer.mlp, RecomputedSwiGLU)
    assert type(layer.input_layernorm).__name__ == "LlamaRMSNorm" and not isinstance(layer.input_layernorm, LeanRMSNorm)
    policy = with_lora(make_tiny_llama(100), LoraConfig(enabled=True, r=4, target_modules=["down_proj"]))
    ids = torch.randint(0, 100, (1, 10))
    policy(input_ids=ids).logits.sum().backward()  # a LoRA-wrapped down_proj: the class's own forward
    assert all(p.grad is not None for n, p in policy.named_parameters() if "lora_" in n and "down_proj" in n)


def test_onednn_caches_are_bounded_unless_the_user_sized_them(monkeypatch):
    """Each new product shape is an entry of oneDNN's caches (~0.2-0.5 MB); at their default 1,024 entries
    they grew an RL run by ~0.4 GB. `use_onednn` sizes both, leaving a size the user chose."""
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    use_onednn(nn.Linear(4, 4))
    assert os.environ["LRU_CACHE_CAPACITY"] == str(ONEDNN_CACHE_ENTRIES)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
