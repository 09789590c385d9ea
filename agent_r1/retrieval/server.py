"""`agent-r1 retrieval-server`: one search index served over HTTP, shared by many rollout workers.

An index is built or loaded once by the server instead of once per worker process. Workers point
`retriever=http://HOST:PORT` at it and get a `RemoteRetriever`, which implements the same
`search(query, k)` as a local index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from agent_r1.retrieval.index import Hit, Passage, Retriever
from agent_r1.task import TaskSpec


class Query(BaseModel):
    query: str
    k: int = Field(3, ge=1, le=100)


@dataclass
class RetrievalServerConfig:
    task: TaskSpec = field(default_factory=lambda: TaskSpec("hotpotqa"))
    """the search task whose index to serve (task.retriever=bm25|dense, task.data=extra paragraphs)"""
    host: str = "127.0.0.1"
    """interface to listen on"""
    port: int = 8766
    """port"""

    def __post_init__(self) -> None:
        if not hasattr(self.task.module, "retriever"):
            raise ValueError(f"task {self.task.name!r} has no search index to serve (it defines no retriever())")
        if getattr(self.task.options, "retriever", "bm25") not in ("bm25", "dense"):
            raise ValueError(f"task.retriever must be bm25 or dense, got {self.task.options.retriever!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")


def create_app(retriever: Retriever, name: str = "index"):
    """POST /search {"query": str, "k": int} -> {"hits": [{"title", "text", "score", "index"}]}."""
    from fastapi import FastAPI

    app = FastAPI(title="agent-r1 retrieval server")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "index": name}

    @app.post("/search")
    def search(q: Query) -> dict[str, Any]:
        hits = retriever.search(q.query, q.k)
        return {
            "hits": [
                {"title": h.passage.title, "text": h.passage.text, "score": h.score, "index": h.index} for h in hits
            ]
        }

    return app


def serve_retrieval(cfg: RetrievalServerConfig) -> None:
    import uvicorn

    kind = cfg.task.options.retriever
    retriever = cfg.task.module.retriever(cfg.task.options)
    print(f"agent-r1 retrieval-server: {kind} index of task {cfg.task.name} at http://{cfg.host}:{cfg.port}/search")
    uvicorn.run(create_app(retriever, kind), host=cfg.host, port=cfg.port, log_level="warning")


class RemoteRetriever:
    """The `Retriever` interface over a retrieval server; a server that fails raises, and the search
    tool turns that into an error observation for the model, not a crashed run."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.client = httpx.Client(timeout=timeout)

    def search(self, query: str, k: int) -> list[Hit]:
        response = self.client.post(f"{self.url}/search", json={"query": query, "k": k})
        response.raise_for_status()
        return [
            Hit(Passage(h["title"], h["text"]), float(h["score"]), int(h["index"])) for h in response.json()["hits"]
        ]
