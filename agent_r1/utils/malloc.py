"""Keep glibc from hoarding freed memory during long CPU runs.

glibc serves blocks above its mmap threshold with mmap and returns them to the OS on free, but it raises
that threshold to the size of every mmapped block freed (up to 32 MB). After the first large free,
PyTorch's many 4-32 MB temporaries (activations, KV buffers, transposed copies) come from the heap
instead, fragment it and are not given back, so the RSS grows well above what the run needs. A fixed 4 MB
threshold keeps them mmapped, and `make demo` peaks much lower. The price is more page faults, which slow
a run a little at most (figures: docs/log/measurements.md). The CLI calls this once at start-up; other
allocators (musl, macOS) are left alone. `release_memory` hands back what a finished phase freed (the
demo calls it between phases, the RL loop after its rollout, update and validation).

The rollout engine is the exception (`engine_heap`): a decode step and a prompt chunk allocate and free
the same 4-32 MB tensors every pass (a 2,048-token chunk's [2048, 1536] MLP states, 64 rows' logits), and
as fresh mappings every page of each faults on its first write: millions of page faults, and a large
share of a rollout's time spent in the kernel (figures: docs/log/measurements.md). While the engine runs,
those stay in the heap.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import sys
import threading
from collections.abc import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
THRESHOLD_BYTES = 4 << 20
# where glibc's dynamic thresholds end up once a process has freed a 32 MB block (its maximum, and twice
# that for the trim threshold): what a process that never fixed them returns to after an engine's run
DYNAMIC_MMAP_MAX, DYNAMIC_TRIM_MAX = 32 << 20, 64 << 20
DEFAULT_TRIM_BYTES = 128 << 10  # glibc's trim threshold, which fixing the mmap threshold leaves as it is
# while an engine runs: its per-pass tensors (<= ~13 MB at 2,048-token chunks) from the heap, which keeps
# up to this much free memory at its top before handing it back
ENGINE_MMAP_BYTES, ENGINE_TRIM_BYTES = 32 << 20, 128 << 20

_fixed: int | None = None  # the threshold `fix_mmap_threshold` set
_engines = 0  # `engine_heap` contexts open
_engines_lock = threading.Lock()


def fix_mmap_threshold(threshold: int = THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold (which also stops its dynamic growth); True if it was set."""
    global _fixed
    if _mallopt(M_MMAP_THRESHOLD, threshold):
        _fixed = threshold
        return True
    return False


@contextlib.contextmanager
def engine_heap() -> Iterator[None]:
    """While a rollout engine decodes: serve blocks up to `ENGINE_MMAP_BYTES` from glibc's heaps and keep
    up to `ENGINE_TRIM_BYTES` free there, so the same per-pass tensors reuse the same resident pages.

    Why: under the CLI's 4 MB mmap threshold each of a pass's larger tensors is a fresh mapping whose pages
    fault on first write and go back to the OS when it is freed. In the search rollout of
    `benchmarks/engines.py` that was 14 M page faults and 33 s of system time; the heap cut them to 2.9 M
    and 8 s, and the rollout from 128 to 110 s (docs/log/measurements.md). It is scoped
    to the engine's decode thread because the trainer's update is where the demo's peak memory is, and
    its activations of every size do fragment a heap (see the module). On leaving, the thresholds are
    what they were (the CLI's fixed one; a process that never fixed them gets glibc's dynamic maxima) and
    the freed pages go back to the OS (`trim_heap`). Nested and concurrent engines share one hold. The
    setting is the process's: in asynchronous RL the update, running beside the engine, allocates under it
    too (its micro-batches still hand their freed pages back, `trim_heap`)."""
    global _engines
    with _engines_lock:
        _engines += 1
        if _engines == 1:
            _mallopt(M_MMAP_THRESHOLD, ENGINE_MMAP_BYTES)
            _mallopt(M_TRIM_THRESHOLD, ENGINE_TRIM_BYTES)
    try:
        yield
    finally:
        with _engines_lock:
            _engines -= 1
            if _engines == 0:
                _mallopt(M_MMAP_THRESHOLD, _fixed or DYNAMIC_MMAP_MAX)
                _mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_BYTES if _fixed else DYNAMIC_TRIM_MAX)
                trim_heap()


def _mallopt(param: int, value: int) -> bool:
    """glibc's `mallopt`; False where there is none (other C libraries)."""
    libc = _libc()
    try:
        return bool(libc.mallopt(param, value)) if libc else False
    except AttributeError:  # not glibc
        return False


def release_memory() -> int:
    """Give what a finished phase freed back to the OS; returns the bytes of RSS released.

    Two things keep a finished phase's memory: objects in reference cycles (an engine and its model
    wait for the cyclic collector, which runs rarely when a few large tensors are all that is
    allocated), and glibc's heaps, which keep freed blocks below the mmap threshold for reuse and
    return nothing in the middle of a heap until asked. Measured in one process: after the demo's
    eval 1.77 GB RSS, 0.69 GB after `gc.collect()`; after its SFT 3.91 GB, still 3.91 after the
    collector, 0.70 GB after `malloc_trim(0)`. Neither changes a computed number. Costs tens of ms."""
    before = _rss()
    gc.collect()
    trim_heap()
    return max(0, before - _rss())


def freeze_imported() -> None:
    """Keep every object alive now out of the cyclic collector's walks, for good: call it once imports are
    done and before anything else is made, so that what it keeps is what imports made (modules, classes,
    functions: ~430,000 objects under torch and transformers), which lives as long as the process anyway.

    Why: a full collection walks them all, ~0.16 s here. `release_memory` runs one after each phase, 3-4
    an RL step, and the collector starts others itself as a rollout allocates; with a small model that
    was most of a step. `gc.freeze` is CPython's own way to do this (its docs suggest it before a fork).
    The objects are handed back at exit, so the interpreter's last collection still reaches them
    (nanobind's extensions report them as leaked otherwise)."""
    gc.freeze()
    atexit.register(gc.unfreeze)


def trim_heap() -> None:
    """Return the free pages in glibc's heaps to the OS (`malloc_trim(0)`); a no-op elsewhere.

    Why between micro-batches: a micro-batch's activations below the 4 MB mmap threshold ([T, hidden]
    states) come from the heaps, and the next micro-batch, a few tokens longer or shorter, cannot reuse
    all of those blocks, so without it the RSS of each forward starts higher than the last one's."""
    if libc := _libc():
        with contextlib.suppress(AttributeError):  # not glibc
            libc.malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library on Linux, looked up once (trim_heap runs after every micro-batch); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _rss() -> int:
    """This process's resident bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
