"""Device and precision: `device=auto|cpu|cuda`, `dtype=fp32|bf16` for every entry point.

The precision policy (as in verl's FSDP workers and Megatron's mixed precision):
- training keeps fp32 master weights and fp32 AdamW state; `dtype=bf16` runs the forward and backward
  matrix products in bf16 under `torch.autocast`, so the optimizer never rounds an update away;
- the LM head, log-softmax, log-probs, entropies, losses and advantages are always fp32: the head runs
  outside autocast (`Fp32Head`), because logits rounded to bf16 are off by up to |z| * 2^-9 (0.06 nats
  at a logit of 30), and a bf16 log-prob by ~1e-2, the size of a PPO clip;
- inference-only commands (eval, chat, serve) have no optimizer, so `dtype=bf16` stores the weights in
  bf16: half the memory, the same compute as autocast.
bf16 is a GPU choice: CPUs without AMX run it slower than fp32 (docs/log/measurements.md), and the oneDNN
linear layers (models/onednn.py) are used only for fp32 on a CPU.

The compute dtype travels with the model (`set_precision`), so every forward — the local engine's
decode thread, the trainer's micro-batches, the reference and the critic — picks it up through
`autocast(model)` without being told.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Literal

import torch

from agent_r1.models.onednn import OneDNNLinear

Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16"]
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
_ATTR = "_agent_r1_compute_dtype"


def resolve_device(name: str) -> torch.device:
    """ "auto" is cuda when a GPU is visible, else cpu; "cuda" without one is a one-line error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False): use device=cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (every tensor fed to it is created there)."""
    return next(model.parameters()).device


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with every parameter and buffer on the CPU, made without a copy on its device.

    `copy.deepcopy` of a model on a GPU clones every weight there first: a whole extra model in GPU
    memory, while vLLM holds its share (an export, a checkpoint, the model Ray ships to its workers).
    Here each tensor goes to the CPU once (tied weights stay one tensor) and the module tree is copied
    around the copies (deepcopy's memo), so no weight is ever cloned on the GPU."""
    memo: dict[int, object] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:
            data = t.detach().to("cpu", copy=True)
            memo[id(t)] = torch.nn.Parameter(data, t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    return copy.deepcopy(model, memo)


def set_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Record the compute dtype on the model: fp32, or bf16 autocast over fp32 weights (the LM head
    then runs in fp32, see `Fp32Head`)."""
    if precision not in TORCH_DTYPES:
        raise ValueError(f"dtype must be fp32 or bf16, got {precision!r}")
    setattr(model, _ATTR, TORCH_DTYPES[precision])
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = type(head) in (torch.nn.Linear, OneDNNLinear)  # not a peft layer or a quantised one
    if precision != "fp32" and plain and head.weight.dtype == torch.float32:
        head.__class__ = Fp32Head  # the same module and weights (ties, state dict, peft untouched)
    return model


class Fp32Head(OneDNNLinear):
    """The LM head in fp32 inside bf16 autocast: what the trainer's log-softmax and the engines' sampling read.

    Under autocast a linear layer rounds its input and weight to bf16 and returns bf16 logits: 8 bits of
    mantissa, an error of up to |z| * 2^-9 per logit, so 0.06 nats at a logit of 30, where a PPO clip
    range is 0.2. The weights are fp32 master weights (training), so running the head in fp32 upcasts
    only the hidden states it is given ([M, H]); it costs one fp32 matrix product over the sampled
    positions (the trainer skips the head elsewhere). Set by `set_precision`; models stored in bf16 for
    inference keep a bf16 head. A `OneDNNLinear` subclass: on a CPU the fp32 product is oneDNN's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return super().forward(x.float())


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype `set_precision` recorded (fp32 when none was)."""
    return getattr(model, _ATTR, torch.float32)


def autocast(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """bf16 autocast on the model's device when `set_precision(model, "bf16")` was called; else nothing.
    Autocast is per thread: the local engine's decode thread enters it itself."""
    dtype = compute_dtype(model)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model_device(model).type, dtype=dtype)


def rng_state() -> dict[str, object]:
    """torch's CPU RNG and, with a GPU, every CUDA device's (a resumed run samples the same dropout and
    initialisations as an uninterrupted one)."""
    state: dict[str, object] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, object]) -> None:
    """Restore `rng_state()`; a checkpoint's CUDA state is ignored on a machine without a GPU."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
