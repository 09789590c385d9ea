"""Task loading (jsonl files, one JSON object per line) and the fixed train / val / test splits."""

from agent_r1.data.jsonl import load_tasks
from agent_r1.data.splits import Split, split_of

__all__ = ["Split", "load_tasks", "split_of"]
