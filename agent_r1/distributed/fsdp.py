"""FSDP2 (`torch.distributed.fsdp.fully_shard`): every rank holds 1/N of each weight, gradient and
AdamW state; a layer's full weights exist only while it runs (PyTorch's FSDP2 design, as in
torchtitan and verl's FSDP workers).

Units: each decoder layer, then the whole model as the root (embeddings, final norm and LM head, tied
or not, in one unit).

Precision (`dtype=bf16`): FSDP2's `MixedPrecisionPolicy`, not autocast. Each decoder layer is gathered
in bf16 (half the all-gather bytes) and computes in bf16; its gradients are reduce-scattered in fp32
into the fp32 master shards. The root stays fp32, so the LM head computes fp32 logits for the fp32
log-softmax (models/precision.py). Autocast would have moved fp32 weights in every collective, and
its cast copies of each gathered layer's weights, saved for backward, add up to a bf16 copy of the whole
unsharded model on every rank after each forward; the policy frees a layer's bf16 weights after its
forward and gathers them again for its backward.

Gradients are reduce-scattered as *sums*, not means: the trainer's losses are already normalised by
the whole mini-batch's token count (all-reduced), so summing the ranks' shares gives exactly the
single-process gradient.

The trainer reads log-probs through the decoder and the LM head separately (trainer/batching.py:
logits only where a sampled token is predicted), not through `model.forward`. FSDP2 gathers the root's
weights only around a forward, so `ROOT_FORWARD` is registered as one: `model.agent_r1_forward(fn,
*args)` runs `fn(*args)` inside the root's pre/post-forward hooks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from agent_r1.models.precision import compute_dtype, set_precision

ROOT_FORWARD = "agent_r1_forward"


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` in place across the process group's ranks (decoder layers in its compute dtype, then
    the root in fp32; see the module docstring)."""
    # the model's compute dtype, or its backbone's (a separate PPO critic wraps a copy of the policy)
    bf16 = [m for m in model.modules() if compute_dtype(m) != torch.float32]
    dtype = compute_dtype(bf16[0]) if bf16 else torch.float32
    layers = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=layers)
    setattr(model, ROOT_FORWARD, _call)
    fully_shard(model)  # the default policy: fp32 parameters, fp32 gradients
    for m in bf16:  # no autocast on top: the policy casts (an LM head stays an Fp32Head)
        set_precision(m, "fp32")
    register_fsdp_forward_method(model, ROOT_FORWARD)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum the ranks' gradients (see the module docstring) ...
            m.set_force_sum_reduction_for_comms(True)  # ... with a plain SUM (gloo has no pre-scaled sum)
    return model


def _call(fn, *args):
    return fn(*args)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: the modules whose classes the model's Hugging Face parts name
    in `_no_split_modules` (the decoder layers and, for a VLM, the vision tower's blocks too: both, since
    the longest list alone is Qwen2-VL's 32 vision blocks, which left its 28-layer language model whole),
    the outermost where they nest. A model that names none: its longest ModuleList; a value head: none."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():  # parents before children
        if id(m) in inside or type(m).__name__ not in names:
            continue
        blocks.append(m)
        inside |= {id(c) for c in m.modules()}
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


@torch.no_grad()
def iter_full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The unsharded weights one tensor at a time (an all-gather each, every rank in the same order), under
    the plain model's names. One at a time: gathering the whole state dict first (`get_model_state_dict`
    with `full_state_dict=True`) holds a whole fp32 model on every GPU beside the shards."""
    for name, t in model.state_dict().items():
        yield name, t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_full_weights(sharded: torch.nn.Module, plain: torch.nn.Module) -> None:
    """Gather `sharded`'s weights into the unsharded copy `plain` (the rollout model, the export) tensor by
    tensor: `plain` may live on the CPU (a vLLM or remote engine), and no whole gathered model ever exists."""
    target = plain.state_dict()
    for name, t in iter_full_weights(sharded):
        target[name].copy_(t)
