"""Append-only JSONL: one line per record, flushed, so a killed run keeps every finished line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
