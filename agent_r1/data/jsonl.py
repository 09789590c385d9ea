"""Read tasks from a jsonl file, failing with one line that names the file and the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tasks(path: str | Path, required: tuple[str, ...] = ("question", "answer")) -> list[dict[str, Any]]:
    """Every line of `path` as a task dict that has the `required` keys."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read data file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"data file {path} is not UTF-8 text") from None
    tasks = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"data file {path} line {n} is not valid JSON ({exc.msg})") from None
        if not isinstance(task, dict) or any(k not in task for k in required):
            raise ValueError(f"data file {path} line {n} must be an object with keys {', '.join(required)}")
        tasks.append(task)
    if not tasks:
        raise ValueError(f"data file {path} holds no tasks")
    return tasks
