"""Where agent-r1 keeps what it builds once and reuses (converted models, search indexes), and how it
replaces a small file without a kill ever leaving half of one."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$AGENT_R1_CACHE, else ~/.cache/agent_r1."""
    return Path(os.environ.get("AGENT_R1_CACHE", Path.home() / ".cache" / "agent_r1"))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a kill leaves the old file or the
    new one, never a truncated one (config.yaml is rewritten on every resume)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
