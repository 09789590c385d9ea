"""Where agent-r1 keeps what it builds once and reuses: converted models, search indexes."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$AGENT_R1_CACHE, else ~/.cache/agent_r1."""
    return Path(os.environ.get("AGENT_R1_CACHE", Path.home() / ".cache" / "agent_r1"))
