"""Where agent-r1 keeps what it builds once and reuses (converted models, search indexes), and how it
replaces a small file without a kill ever leaving half of one."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$AGENT_R1_CACHE, else ~/.cache/agent_r1."""
    return Path(os.environ.get("AGENT_R1_CACHE", Path.home() / ".cache" / "agent_r1"))


def save_tensors_atomic(tensors: dict, path: str | Path, tmp_dir: str | Path | None = None) -> None:
    """Write `tensors` as safetensors through a temporary file (in `tmp_dir`, default beside `path`) and a
    rename: a reader (a server loading pushed weights) never sees half a file, a kill leaves none."""
    import tempfile

    from safetensors.torch import save_file

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=tmp_dir or path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a kill leaves the old file or the
    new one, never a truncated one (config.yaml is rewritten on every resume)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
