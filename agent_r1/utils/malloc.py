"""Keep glibc from hoarding freed memory during long CPU runs.

glibc serves blocks above its mmap threshold with mmap and returns them to the OS on free, but it
raises that threshold to the size of every mmapped block freed (up to 32 MB). After the first large
free, PyTorch's many 4-32 MB temporaries (activations, KV buffers, transposed copies) come from the
heap instead, fragment it and are not given back: `make demo` peaked at 16.8 GB RSS. A fixed 4 MB
threshold keeps them mmapped: the demo then peaks at ~10 GB. The price is more page faults; two RL
steps showed no slowdown, whole demo runs maybe 5-10% (docs/benchmarks.md). The CLI calls this
once at start-up; other allocators (musl, macOS) are left alone. `release_memory` hands back what a
finished phase freed (the demo calls it between phases, the RL loop after its rollout, update and
validation).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD_BYTES = 4 << 20


def fix_mmap_threshold(threshold: int = THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold (which also stops its dynamic growth); True if it was set."""
    libc = _libc()
    try:
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) if libc else False
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
