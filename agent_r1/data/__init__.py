"""Task loading: jsonl files of tasks (one JSON object per line)."""

from agent_r1.data.jsonl import load_tasks

__all__ = ["load_tasks"]
