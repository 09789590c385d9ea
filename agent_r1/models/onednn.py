"""Run a model's fp32 linear layers through oneDNN on x86 CPUs, forward and backward.

Why: PyTorch's CPU matmul calls MKL's sgemm, and MKL takes its AVX2 code path on CPUs that are not
Intel's. On this project's AMD EPYC (AVX-512), MKL reaches ~210 GFLOP/s at 1024 rows; oneDNN, which
ships inside PyTorch and dispatches on the CPU's actual features, reaches ~440. At the 16-row batches
of decoding the gap is the same: 71 against 150 GFLOP/s (benchmarks/kernels.py, docs/benchmarks.md). Linear layers are
about 75% of both a decode step and a training step, so this halves most of the time of an RL step.

The switch is a class swap: each `nn.Linear` becomes a `OneDNNLinear`, a subclass whose forward
calls `torch.ops.mkldnn._linear_pointwise` (the op `torch.compile`'s CPU backend emits for linear
layers) and whose backward computes both gradients with the same op on transposed views. Weights,
state dicts, peft wrapping and `deepcopy` are unchanged. The results differ from MKL's only by fp32
rounding (relative ~1e-6); the rollout and the trainer use the same kernels, and the log-prob
consistency test (docs/architecture.md, "Log-probs and the consistency check") guards the difference.
Set `AGENT_R1_ONEDNN=0` to keep MKL.
"""

from __future__ import annotations

import inspect
import os
import platform

import torch
import torch.nn.functional as F
from torch import nn


def onednn_available() -> bool:
    """oneDNN's linear op exists (an x86 PyTorch build with mkldnn) and the user has not opted out."""
    return (
        os.environ.get("AGENT_R1_ONEDNN", "1") != "0"
        and platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias with oneDNN: x [..., in], weight [out, in] (strided views are fine) -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _LinearFn(torch.autograd.Function):
    """F.linear's gradients, with every product computed by oneDNN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # [N, out]
        grad_x = _linear(grad, weight.t()) if ctx.needs_input_grad[0] else None  # [..., in] = grad @ W
        grad_w = _linear(g.t(), x.reshape(-1, x.shape[-1]).t()) if ctx.needs_input_grad[1] else None  # [out, in]
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` computed by oneDNN when input and weight are fp32 on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dtype != torch.float32
            or w.dtype != torch.float32
            or x.device.type != "cpu"
            or x.numel() == 0
            or torch.is_autocast_enabled("cpu")  # bf16 compute: F.linear is what autocast casts
        ):
            return F.linear(x, w, self.bias)
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return _LinearFn.apply(x, w, self.bias)
        return _linear(x, w, self.bias)


class _SwiGLUDownFn(torch.autograd.Function):
    """down(silu(gate) * up), holding only `gate` and `up` for backward.

    Why: autograd through transformers' `down_proj(act_fn(gate_proj(x)) * up_proj(x))` holds four
    [T, intermediate] tensors a layer (gate, silu(gate), up, their product): half of a training
    forward's activations on Llama-family models. silu(gate) and the product are two elementwise ops
    to recompute in backward, small beside the [T, intermediate] x [intermediate, hidden] products the
    gradients need anyway, so this holds two of the four. Every gradient is
    computed by the same ops as autograd's (oneDNN products, `silu_backward`), so they are the same to
    the bit (tests/models/test_onednn.py)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return _linear(F.silu(gate) * up, weight, bias)  # [..., hidden]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        act = F.silu(gate)
        g = grad.reshape(-1, grad.shape[-1])  # [N, hidden]
        grad_w = grad_b = None
        if ctx.needs_input_grad[2]:
            h = act * up  # [..., intermediate] recomputed
            grad_w = _linear(g.t(), h.reshape(-1, h.shape[-1]).t())  # [hidden, intermediate]
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = g.sum(0)
        grad_h = _linear(grad, weight.t())  # [..., intermediate]
        return torch.ops.aten.silu_backward(grad_h * up, gate), grad_h * act, grad_w, grad_b


# the forward bodies of the MLPs whose activations `_SwiGLUDownFn` holds fewer of (Llama, Qwen 2/3, Mistral, ...)
_SWIGLU = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
SWIGLU_FORWARDS = ([f"return {_SWIGLU}"], [f"down_proj = {_SWIGLU}", "return down_proj"])


class RecomputedSwiGLU:
    """Mixed into a Llama-family MLP class whose forward is one of `SWIGLU_FORWARDS`, with a SiLU: while
    training in fp32 on the CPU with a plain (not LoRA-wrapped) `down_proj`, the forward is
    `_SwiGLUDownFn`; otherwise the class's own. Copies and pickles are of the original class (the
    rollout copies never train)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        if (
            type(down) is OneDNNLinear
            and torch.is_grad_enabled()
            and x.dtype == torch.float32
            and down.weight.dtype == torch.float32
            and x.device.type == "cpu"
            and not torch.is_autocast_enabled("cpu")
        ):
            return _SwiGLUDownFn.apply(self.gate_proj(x), self.up_proj(x), down.weight, down.bias)
        return super().forward(x)

    def __reduce_ex__(self, protocol):
        return _as_class, (self.__class__.__bases__[1], self.__dict__)


def _as_class(cls: type, state: dict) -> nn.Module:
    """An object of `cls` with `state` (how `RecomputedSwiGLU` modules copy and pickle)."""
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


_SWIGLU_CLASSES: dict[type, type] = {}


def _recomputed_swiglu(module: nn.Module) -> bool:
    """Mix `RecomputedSwiGLU` into `module`'s class if its forward is the SwiGLU one; True if it was."""
    from transformers.activations import SiLUActivation  # here: benchmarks/kernels.py is "kernels" to transformers

    cls, act = type(module), getattr(module, "act_fn", None)
    if isinstance(module, RecomputedSwiGLU) or not isinstance(act, nn.SiLU | SiLUActivation):
        return False
    if cls not in _SWIGLU_CLASSES:
        try:
            lines = [line.strip() for line in inspect.getsource(cls.forward).splitlines()[1:]]
        except (OSError, TypeError):
            return False
        if [line for line in lines if line] not in SWIGLU_FORWARDS:
            return False
        _SWIGLU_CLASSES[cls] = type(cls.__name__, (RecomputedSwiGLU, cls), {"__module__": cls.__module__})
    module.__class__ = _SWIGLU_CLASSES[cls]
    return True


def use_onednn(model: nn.Module) -> int:
    """Swap every `nn.Linear` of `model` to `OneDNNLinear` in place; returns how many were swapped
    (0 when oneDNN is unavailable or switched off).

    On a machine without a GPU it also lets SDPA run grouped-query attention itself when there is a
    mask (`TRANSFORMERS_SDPA_FORCE_GQA`): transformers otherwise copies every key and value head
    `num_key_value_groups` times first (`repeat_kv`). On this CPU the masked attention of a [64, 60]
    prefill over 360 keys takes 33 ms instead of 81, with bitwise the same output (docs/benchmarks.md).
    On CUDA, SDPA falls back to its slow math kernel for GQA with a mask, so the default stays there.

    Llama-family MLPs (`SWIGLU_FORWARDS`) get `RecomputedSwiGLU` mixed into their class: in training
    they hold two of their four intermediate activations (`_SwiGLUDownFn`).
    """
    if not onednn_available():
        return 0
    if not torch.cuda.is_available():
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            swapped += 1
    for module in model.modules():
        _recomputed_swiglu(module)
    return swapped
