"""`release_openmp_workers` ends the calling thread's libgomp team and no other thread's. Counted as the
process's native threads (/proc/self/task) in a fresh interpreter: a team of two is its caller plus one
worker thread, made by the first parallel region the caller runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (loads PyTorch's libgomp, as every caller of the function has)

from agent_r1.utils.openmp import _libgomp

maps = Path("/proc/self/maps")
pytestmark = pytest.mark.skipif(
    not maps.exists() or "/libgomp" not in maps.read_text(), reason="PyTorch here does not run on GNU libgomp"
)

PROBE = """
import json, os, threading, torch
from agent_r1.utils.openmp import release_openmp_workers
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def parallel_region():
    (torch.ones(4096, 1024) * 2).sum()  # an elementwise op this large runs in parallel
counts = {"start": threads()}
parallel_region()
counts["main's team"] = threads()
ready, leave = threading.Event(), threading.Event()
def other():
    parallel_region()
    ready.set()
    leave.wait()
    counts["other released"] = release_openmp_workers()
    counts["other's team gone"] = threads()
t = threading.Thread(target=other)
t.start()
ready.wait()
counts["both teams"] = threads()
counts["main released"] = release_openmp_workers()
counts["main's team gone"] = threads()
counts["main released again"] = release_openmp_workers()
leave.set()
t.join()
parallel_region()
counts["main's new team"] = threads()
print(json.dumps(counts))
"""


def test_a_thread_releases_its_own_team_and_no_other():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    n = json.loads(out.stdout)
    start = n["start"]
    assert n["main's team"] == start + 1  # the main thread's first parallel region made one worker
    assert n["both teams"] == start + 3  # the other thread, and its own worker
    assert n["main released"] and n["main's team gone"] == start + 2  # only the main thread's worker ended
    assert n["main released again"]  # with no team it is a no-op that succeeds
    assert n["other released"] and n["other's team gone"] == start + 1  # the other thread's worker ended
    assert n["main's new team"] == start + 1  # the next region makes a new team


def test_libgomp_is_the_one_pytorch_loaded():
    assert _libgomp() is not None
