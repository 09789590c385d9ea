"""The `search` tool the model calls: a query in, the top-k passages out as numbered, titled text."""

from __future__ import annotations

from agent_r1.retrieval.index import Hit, Retriever
from agent_r1.tools import Tool, tool

MAX_K = 10  # a model cannot ask for the whole corpus


def format_hits(hits: list[Hit]) -> str:
    """`Doc 1 (Title: X) text` per hit, the layout Search-R1 and Agent-R1 show retrieved passages in."""
    if not hits:
        return "No results."
    return "\n".join(f"Doc {n} (Title: {h.passage.title}) {h.passage.text}" for n, h in enumerate(hits, 1))


def search_tool(retriever: Retriever, timeout: float = 10.0) -> Tool:
    """A `search(query, k)` tool over `retriever` (a local index or a retrieval server)."""

    @tool(timeout=timeout)
    def search(query: str, k: int = 3) -> str:
        """Search Wikipedia paragraphs and return the best matches with their titles.

        Args:
            query: What to look for, for example a person, a film or a place.
            k: How many paragraphs to return (1 to 10).
        """
        return format_hits(retriever.search(query, max(1, min(k, MAX_K))))

    return search
