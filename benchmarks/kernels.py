"""Linear-layer throughput on this CPU: PyTorch's default (MKL sgemm) against oneDNN, forward and backward.

The shapes are SmolLM2-135M's MLP (576 -> 1536) with 90 distinct weight matrices, so the weights come from
memory as they do in a real forward pass, and its vocabulary projection (576 -> 49152). Rows = tokens in
the batch: 16 is a decode step of one GRPO batch, 1024 a training micro-batch. Backward = the input and
weight gradients of one layer. agent-r1 picks oneDNN (agent_r1/models/onednn.py) because of this table.

    python benchmarks/kernels.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from agent_r1.models.onednn import _linear, onednn_available

HIDDEN, MLP, VOCAB = 576, 1536, 49152


def seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up (oneDNN builds its kernel for a new shape once)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    if not onednn_available():
        raise SystemExit("oneDNN's linear op is not available in this PyTorch build (or AGENT_R1_ONEDNN=0)")
    torch.manual_seed(0)
    weights = [torch.randn(MLP, HIDDEN) for _ in range(90)]
    head = torch.randn(VOCAB, HIDDEN)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s (higher is better)")
    header = ("rows", "MLP fwd MKL", "oneDNN", "MLP bwd MKL", "oneDNN", "head fwd MKL", "oneDNN")
    print("{:>5} | {:>11} {:>7} | {:>11} {:>7} | {:>12} {:>7}".format(*header))
    for rows in (1, 16, 64, 256, 1024):
        x = torch.randn(rows, HIDDEN)
        g = torch.randn(rows, MLP)
        repeat = 2 if rows >= 256 else 5
        flops = 2 * rows * HIDDEN * MLP * len(weights)
        fwd_mkl = seconds(lambda: [F.linear(x, w) for w in weights], repeat)  # noqa: B023
        fwd_dnn = seconds(lambda: [_linear(x, w) for w in weights], repeat)  # noqa: B023
        bwd_mkl = seconds(lambda: [(g @ w, g.t() @ x) for w in weights], repeat)  # noqa: B023
        bwd_dnn = seconds(lambda: [(_linear(g, w.t()), _linear(g.t(), x.t())) for w in weights], repeat)  # noqa: B023
        head_flops = 2 * rows * HIDDEN * VOCAB
        head_mkl = seconds(lambda: F.linear(x, head), repeat)  # noqa: B023
        head_dnn = seconds(lambda: _linear(x, head), repeat)  # noqa: B023
        print(
            f"{rows:5d} | {flops / fwd_mkl / 1e9:11.0f} {flops / fwd_dnn / 1e9:7.0f} | "
            f"{2 * flops / bwd_mkl / 1e9:11.0f} {2 * flops / bwd_dnn / 1e9:7.0f} | "
            f"{head_flops / head_mkl / 1e9:12.0f} {head_flops / head_dnn / 1e9:7.0f}"
        )


if __name__ == "__main__":
    main()
