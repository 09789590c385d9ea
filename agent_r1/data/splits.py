"""Fixed train / validation / test splits by a stable hash of each task's question.

A task's split depends on its text alone, never on a seed or on which other tasks exist, so the
splits are disjoint by construction for generated problems and files alike. `test` is the held-out
split that `agent-r1 eval` and `make demo` report; `val` is what training may look at while it runs
(validation curves, best-checkpoint selection) without ever touching the held-out numbers.
"""

from __future__ import annotations

import hashlib
from typing import Literal

Split = Literal["train", "val", "test"]


def split_of(question: str) -> Split:
    """10% test (bucket 0), 10% validation (bucket 1), 80% train, by sha256 of the question."""
    bucket = int(hashlib.sha256(question.encode()).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"
