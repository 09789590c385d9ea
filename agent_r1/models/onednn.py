"""Run a model's fp32 linear layers through oneDNN on x86 CPUs, forward and backward.

Why: PyTorch's CPU matmul calls MKL's sgemm, and MKL takes its AVX2 code path on CPUs that are not
Intel's. On this project's AMD EPYC (AVX-512), oneDNN, which ships inside PyTorch and dispatches on the
CPU's actual features, is much faster than MKL, for large matmuls and for the few-row batches of decoding
alike (figures: benchmarks/kernels.py, docs/log/measurements.md). Linear layers take most of the time of
both a decode step and a training step, so most of an RL step runs at oneDNN's speed instead of MKL's.

The switch is a class swap: each `nn.Linear` becomes a `OneDNNLinear`, a subclass whose forward calls
`torch.ops.mkldnn._linear_pointwise` (the op `torch.compile`'s CPU backend emits for linear layers) and
whose backward computes both gradients with the same op on transposed views. Weights, state dicts, peft
wrapping and `deepcopy` are unchanged. The results differ from MKL's only by fp32 rounding (figures:
docs/log/measurements.md); the rollout and the trainer use the same kernels, and the log-prob consistency
test (docs/architecture.md, "Log-probs and the consistency check") guards the difference. Set
`AGENT_R1_ONEDNN=0` to keep MKL.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import platform
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

# Entries in each of oneDNN's caches of prepared products: its primitive cache and ideep's computation
# cache (env ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY; both 1,024 by default, read when
# first used). Why: an entry is a product's shape (rows x weight), and each holds ~0.2-0.5 MB. The rows
# change with every training micro-batch and decode step, so at their default capacity the two caches
# grew a training process by ~0.4 GB over its first RL steps (docs/log/measurements.md). Making a product
# again costs little beside computing it: 64 entries changed no timing we measured, and the same
# shape always gets the same kernel, so no result changes.
ONEDNN_CACHE_ENTRIES = 64


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


# The weights this thread multiplies by in oneDNN's own layout, while it holds `packed_weights`:
# module -> (the weight's version and address when packed, the packed weight).
Packs = dict[nn.Module, tuple[tuple[int, int], torch.Tensor]]
_PACKS: ContextVar[Packs | None] = ContextVar("agent_r1_packs", default=None)
PACKED_ROWS = 64  # the rows oneDNN is told to expect when it chooses the packed layout (a decode step's)


@contextlib.contextmanager
def packed_weights(packs: Packs) -> Iterator[None]:
    """While held, this thread's inference products of two rows or more multiply by weights kept in
    oneDNN's blocked layout, in `packs` (the caller's: it decides how long the copies live).

    Why: given a plain [out, in] weight, oneDNN reorders it into the layout its kernel reads on every
    call. At 1,024 rows that copy is nothing beside the product; at a decode step's 64 rows it is
    15-20% of the product's time (the weight is read and written once more than it is used). Here each
    weight is reordered on its first product, and again only if it has changed since (its `_version`
    or its storage moved; a weight made under `torch.inference_mode` has no version and stays plain).
    The copies take as much memory as the weights they copy. A one-row product keeps the plain weight:
    oneDNN computes it with another kernel whose rounding differs; every product of two rows and more is
    the same to the bit either way (tests/models/test_onednn.py)."""
    token = _PACKS.set(packs)
    try:
        yield
    finally:
        _PACKS.reset(token)


def _packed(module: nn.Module, weight: torch.Tensor, packs: Packs) -> torch.Tensor:
    """`module`'s weight in oneDNN's layout, packed now if it was not or has changed since."""
    key = (weight._version, weight.data_ptr())
    entry = packs.get(module)
    if entry is None or entry[0] != key:
        entry = packs[module] = (key, torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS))
    return entry[1]


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
        packs = _PACKS.get()
        if packs is not None and x.numel() > x.shape[-1] and not w.is_inference():  # 2+ rows: the same to the bit
            return _linear(x, _packed(self, w, packs), self.bias)
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


class _RMSNormScaleFn(torch.autograd.Function):
    """weight * (x * r), holding x and r ([..., 1]) for backward, not the normalised x * r.

    Why: autograd through transformers' Llama-family RMSNorm holds x, r = rsqrt(mean(x^2) + eps) and the
    normalised x * r (for the weight's gradient) besides the output that the next linear layers hold:
    one more [T, hidden] tensor a norm, two a decoder layer. x * r is one multiplication to redo in
    backward. Only the two multiplications are one node here; x^2, its mean and the rsqrt stay autograd's,
    so x's gradients arrive in the order they do without it, and every gradient is autograd's to the bit
    (the same ops on the same values: tests/models/test_onednn.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, r, weight)
        return weight * (x * r)  # [..., hidden]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, r, weight = ctx.saved_tensors
        grad_n = grad * weight  # [..., hidden]
        grad_w = None
        if ctx.needs_input_grad[2]:  # summed over the leading dimensions, as autograd's sum_to does
            grad_w = (grad * (x * r)).sum(tuple(range(grad.dim() - 1)), keepdim=True).view(weight.shape)
        return grad_n * r, (grad_n * x).sum(-1, keepdim=True), grad_w


def _trains_in_fp32_on_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A training forward in fp32 on the CPU (not under bf16 autocast): where the mixins take over."""
    return (
        torch.is_grad_enabled()
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
    )


class ForwardMixin:
    """Base of the mixins (`mix_in`): copies and pickles are of the original class (the rollout's copies
    never train, and Ray ships CPU copies)."""

    def __reduce_ex__(self, protocol):
        return _as_class, (self.__class__.__bases__[1], self.__dict__)


class RecomputedSwiGLU(ForwardMixin):
    """Mixed into a Llama-family MLP class whose forward is one of `SWIGLU_FORWARDS`, with a SiLU: while
    training in fp32 on the CPU with a plain (not LoRA-wrapped) `down_proj`, the forward is
    `_SwiGLUDownFn`; otherwise the class's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        if type(down) is OneDNNLinear and _trains_in_fp32_on_cpu(x, down.weight):
            return _SwiGLUDownFn.apply(self.gate_proj(x), self.up_proj(x), down.weight, down.bias)
        return super().forward(x)


class LeanRMSNorm(ForwardMixin):
    """Mixed into a Llama-family RMSNorm class whose forward is `RMSNORM_FORWARD`: while training in fp32
    on the CPU its scaling is `_RMSNormScaleFn`; otherwise the class's own forward."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _trains_in_fp32_on_cpu(hidden_states, self.weight):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)  # [..., 1]
            return _RMSNormScaleFn.apply(hidden_states, torch.rsqrt(variance + self.variance_epsilon), self.weight)
        return super().forward(hidden_states)


def _as_class(cls: type, state: dict) -> nn.Module:
    """An object of `cls` with `state` (how the mixins' modules copy and pickle)."""
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


# the forward bodies that the mixins stand in for (Llama, Qwen 2/3, Mistral, SmolLM2, ...)
_SWIGLU = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
SWIGLU_FORWARDS = ([f"return {_SWIGLU}"], [f"down_proj = {_SWIGLU}", "return down_proj"])
RMSNORM_FORWARD = [
    "input_dtype = hidden_states.dtype",
    "hidden_states = hidden_states.to(torch.float32)",
    "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
    "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
    "return self.weight * hidden_states.to(input_dtype)",
]
_MIXED: dict[tuple[type, type], type | None] = {}  # (mixin, class) -> the mixed class; None: another forward


def mix_in(module: nn.Module, mixin: type, forwards: tuple[list[str], ...]) -> bool:
    """Mix `mixin` into `module`'s class if the class's forward body (its statements after the signature,
    a line each, stripped) is one of `forwards`; True if it was. The body, not the class, is checked: a
    mixin stands in for exactly the code it was written against, whichever model family carries it."""
    cls = type(module)
    if (mixin, cls) not in _MIXED:
        try:
            lines = [line.strip() for line in inspect.getsource(cls.forward).splitlines()]
        except (OSError, TypeError):
            lines = []
        signature = next((i for i, line in enumerate(lines) if line.endswith(":")), len(lines))
        same = [line for line in lines[signature + 1 :] if line] in forwards
        _MIXED[mixin, cls] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__}) if same else None
    if _MIXED[mixin, cls] is None:
        return False
    module.__class__ = _MIXED[mixin, cls]
    return True


def _recompute_in_backward(module: nn.Module) -> bool:
    """Mix `RecomputedSwiGLU` into a SwiGLU MLP with a SiLU, or `LeanRMSNorm` into an RMSNorm; True if mixed."""
    from transformers.activations import SiLUActivation  # here: benchmarks/kernels.py is "kernels" to transformers

    if isinstance(module, ForwardMixin):
        return False
    if isinstance(getattr(module, "act_fn", None), nn.SiLU | SiLUActivation):
        return mix_in(module, RecomputedSwiGLU, SWIGLU_FORWARDS)
    if hasattr(module, "variance_epsilon") and isinstance(getattr(module, "weight", None), nn.Parameter):
        return mix_in(module, LeanRMSNorm, (RMSNORM_FORWARD,))
    return False


def use_onednn(model: nn.Module) -> int:
    """Swap every `nn.Linear` of `model` to `OneDNNLinear` in place; returns how many were swapped
    (0 when oneDNN is unavailable or switched off).

    On a machine without a GPU it also lets SDPA run grouped-query attention itself when there is a
    mask (`TRANSFORMERS_SDPA_FORCE_GQA`): transformers otherwise copies every key and value head
    `num_key_value_groups` times first (`repeat_kv`). On this CPU the masked attention of a [64, 60]
    prefill over 360 keys takes 33 ms instead of 81, with bitwise the same output (docs/log/measurements.md).
    On CUDA, SDPA falls back to its slow math kernel for GQA with a mask, so the default stays there.

    Llama-family MLPs (`SWIGLU_FORWARDS`) get `RecomputedSwiGLU` mixed into their class and RMSNorms
    (`RMSNORM_FORWARD`) `LeanRMSNorm`: in training they hold two of their four intermediate activations
    (`_SwiGLUDownFn`) and one of two (`_RMSNormScaleFn`).

    It also bounds oneDNN's two caches of prepared products (`ONEDNN_CACHE_ENTRIES`), unless the
    user set them.
    """
    if not onednn_available():
        return 0
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))
    if not torch.cuda.is_available():
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            swapped += 1
    for module in model.modules():
        _recompute_in_backward(module)
    return swapped
