"""Keep glibc from hoarding freed memory during long CPU runs.

glibc serves blocks above its mmap threshold with mmap and returns them to the OS on free, but it
raises that threshold to the size of every mmapped block freed (up to 32 MB). After the first large
free, PyTorch's many 4-32 MB temporaries (activations, KV buffers, transposed copies) come from the
heap instead, fragment it and are not given back: `make demo` peaked at 16.8 GB RSS. A fixed 4 MB
threshold keeps them mmapped: the demo then peaks at ~10 GB. The price is more page faults; two RL
steps showed no slowdown, whole demo runs maybe 5-10% (docs/benchmarks.md). The CLI calls this
once at start-up; other allocators (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD_BYTES = 4 << 20


def fix_mmap_threshold(threshold: int = THRESHOLD_BYTES) -> bool:
    """Set glibc's mmap threshold (which also stops its dynamic growth); True if it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc
        return False
