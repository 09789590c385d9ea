"""The CPU decode-attention kernel (`decode_attention.cpp`): built on first use, SDPA where it cannot be.

At decode each row has one query a head, so attention is bound by reading the row's keys and values.
PyTorch's SDPA runs that as a batch of tiny GEMMs, which read the keys far below the machine's read
speed, and needs rows of one width per call, so the engine cut the rows into segments
(`local_engine._row_runs`). The kernel takes every decoding row of a pass in one call, each reading
exactly its own columns, and reads a kv head's keys once for all the query heads that share it: several
times SDPA's speed with its portable loops, and more with AVX-512 (figures: `benchmarks/attention.py`,
docs/log/measurements.md). It is the split of FlashDecoding (Dao et al. 2023) by sequence and head, the
work vLLM's CPU paged-attention kernel does over pages.

A prompt chunk's tokens are rows of the same call, each reading its slot up to its own column (causal
attention). The kernel finds them as runs of rows in one slot, one column apart, and takes them in tiles
of 16 tokens whose queries fill a vector's lanes (an AVX-512 register; two AVX2 ones or four NEON ones in
the portable loops): each key is read once for the tile and for the query heads that share it, not once a
token. With AVX-512 that is faster than a row a token and than SDPA's flash kernel over a masked chunk;
an AVX2 build's portable tiles are faster than its rows and about as fast as SDPA's with torch on AVX2
too (figures: docs/log/measurements.md). A lane's sums are its own, so a token's output does not depend
on where its prompt was cut into chunks. The threads split the work by the columns it reads, so a chunk's
long rows and the decoding rows' short ones are shared evenly.

It is compiled for this CPU (`-march=native`) with the system's C++ compiler through
`torch.utils.cpp_extension` (ninja), once per machine, into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); the first use waits for the build. The
build's name carries a digest of the source and of the CPU's flags, so a home directory shared by unlike
machines never loads a build made for another CPU. Where it cannot be built (no compiler, no OpenMP), or
for a dtype or device it does not cover (fp32 queries over fp32 or bf16 keys and values, on the CPU),
`kernel_for` says None and the engine runs SDPA per segment as before: the same results to rounding,
slower.

Keys and values stored in bf16 (`LocalEngine(kv_cache_dtype=torch.bfloat16)`, `agent-r1 serve
kv_cache_dtype=bf16`) are widened to fp32 as they are read: a shift of each 16-bit value, in registers.

With head_dim 64 or 128, a decoding row's intrinsics sum a register's worth of keys' scores at a time (16
on a CPU with AVX-512, 8 on one with AVX2 and FMA: most laptops) and keep the weighted sum of the values
in registers. Both the AVX-512 path and an AVX2 build's (`benchmarks/attention.py --march x86-64-v3`) are
faster than their portable loops, more so over bf16 than over fp32, and read keys and values from memory
close to the machine's read speed over fp32, somewhat below it over bf16: both keep the reads of the key
and value 32 positions on in flight (figures: docs/log/measurements.md). Every other CPU or shape, and an
AVX2 build's prompt tiles, run the portable loops, which the compiler vectorizes;
`torch.ops.agent_r1.decode_attention_portable` runs them on any CPU, so the tests cover both, and an AVX2
build is tested beside this CPU's.

The same library holds `rope_store`: a layer's rotary embedding and its keys' and values' writes to their
slots in one op, for `kv_cache.FusedSlotAttention`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
STALE_LOCK_S = 600  # a build takes ~30 s: a lock this old was left by a build that was killed


KV_DTYPES = (torch.float32, torch.bfloat16)  # the keys and values the kernel reads (fp32 queries)


def kernel_for(dtype: torch.dtype | None, device: torch.device) -> Callable | None:
    """The kernel for keys of this dtype on this device, or None where SDPA must do (see the module)."""
    if dtype not in KV_DTYPES or device.type != "cpu" or sys.platform == "win32":
        return None
    return _build()


def _cpu_digest() -> str:
    """A digest of what `-march=native` compiles for: the CPU's model and flags where Linux says them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("flags", "model name", "Features"))][:2]
    except OSError:
        lines = []
    return hashlib.sha256("\n".join([platform.machine(), platform.processor(), *lines]).encode()).hexdigest()[:12]


@functools.cache
def _build(march: str = "native") -> Callable | None:
    """Compile and load the kernel once per process (torch's cache skips the compile on later runs).

    `march` other than this CPU's (`x86-64-v3`: AVX2, what most laptops have) is for
    `benchmarks/attention.py --march`, which measures another CPU's build here; one build a process."""
    from torch.utils import cpp_extension

    tag = SOURCE.read_bytes() + torch.__version__.encode() + march.encode()
    name = f"agent_r1_decode_attention_{hashlib.sha256(tag).hexdigest()[:8]}_{_cpu_digest()}"
    # `pip install ninja` puts it in the environment's bin, which is not on PATH when the venv's commands
    # run without activating it (`make test`, `.venv/bin/agent-r1`); torch looks for it on PATH
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        build = Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:  # a torch that moved its private helper: build without the notice
        build = None
    if build is not None:
        built = build / f"{name}.so"  # its name is of this source, torch and CPU: loaded without torch's lock,
        if built.exists():  # which a process killed while holding it (a kill mid-rollout) would leave behind
            try:
                torch.ops.load_library(str(built))
                return torch.ops.agent_r1.decode_attention
            except Exception:  # a build cut short: build it again
                built.unlink(missing_ok=True)
        lock = build / "lock"  # a build killed midway leaves torch's lock, and every later load would wait on it
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
        log.info("compiling the CPU decode-attention kernel for this machine (once, about half a minute)")
    try:
        cpp_extension.load(
            name,
            [str(SOURCE)],
            extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, no OpenMP: SDPA does the same work, slower
        reason = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
        log.warning("agent-r1's CPU decode-attention kernel did not build (%s); decode runs on SDPA", reason)
        return None
    return torch.ops.agent_r1.decode_attention
