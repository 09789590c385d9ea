"""Hand back a thread's idle OpenMP workers before it waits on the rollout engine.

PyTorch's CPU kernels run their parallel loops on OpenMP, on Linux GNU libgomp. libgomp gives every
thread that starts a parallel region a team of workers of its own and keeps it for the thread's life.
The trainer's thread has one after its first update, eval or model load; the engine's decode thread
makes another. Once a process's teams hold more workers than it has CPUs, libgomp assumes the CPUs
are oversubscribed: a worker that finishes a region spins ~100 times instead of ~300,000 for the next
one, then sleeps on a futex (its "throttled spin count", libgomp's env.c and wait.h). A decode step is
hundreds of short parallel regions, and each then waits for its workers to be woken.

Decode is markedly slower once a single elementwise op on the main thread has given that thread a team
too, and back to its speed after that thread releases its team (figures: docs/log/measurements.md). The
same happened after `benchmarks/decode.py` measured its matmul ceiling, and in every rollout that
followed an update.

The decode thread exits when the engine goes idle, so its team never slows the trainer. The threads
that submit requests and then wait release theirs (`LocalEngine._submit`, `VLLMEngine.generate`), as
does the asynchronous trainer when it must wait for groups (`AsyncRollout._next_ready`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: a soft pause frees the threads; the next region makes new ones


def release_openmp_workers() -> bool:
    """End the calling thread's OpenMP team (OpenMP 5.0's `omp_pause_resource_all`); True if libgomp ran it.

    Only the caller's own team goes (libgomp's `gomp_pause_host`); other threads' teams and a region in
    progress are untouched (inside a region it refuses). The next parallel region on this thread starts
    a new team: one `pthread_create` per worker, microseconds. A no-op where PyTorch does not use libgomp
    (macOS's LLVM libomp pauses every thread's team, so it is left alone)."""
    gomp = _libgomp()
    return gomp is not None and gomp.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (PyTorch's copy), looked up once; None if there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)  # only one already loaded, never a new one
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        return lib
    except (OSError, AttributeError):
        return None
