"""`agent-r1 view RUN_DIR`: a local web page to browse what the agent did, turn by turn and token by token.

The server (FastAPI) only reads trajectory records (`agent_r1.observe.records`): a run directory's
`trajectories/step_*.jsonl.gz` or one records file such as `agent-r1 eval out=...` writes. The page is
one static HTML file with plain JavaScript: nothing to build, nothing fetched from the internet.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from agent_r1.observe.records import read_records, step_files

PAGE = Path(__file__).with_name("index.html")


@dataclass
class ViewConfig:
    run_dir: str = ""
    """a run directory (trajectories/step_*.jsonl.gz) or one records file (.jsonl or .jsonl.gz)"""
    host: str = "127.0.0.1"
    """interface to listen on (loopback by default: the page shows your data)"""
    port: int = 8765
    """port of the page"""

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("give a run directory or a trajectories file: agent-r1 view RUN_DIR")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")


class TrajectoryStore:
    """Records by step, read lazily and cached: a long run is opened step by step, not all at once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            self.files = step_files(self.path)
            if not self.files:
                raise ValueError(f"{self.path}: no trajectories/step_*.jsonl.gz (train with log.trajectories_every>0)")
        elif self.path.is_file():
            self.files = {0: self.path}  # one file: its records are "step 0" unless they carry a step
        else:
            raise ValueError(f"{self.path}: no such run directory or trajectories file")
        self._load = lru_cache(maxsize=16)(self._read)

    def _read(self, step: int) -> list[dict[str, Any]]:
        return list(read_records(self.files[step]))

    def steps(self) -> list[int]:
        return list(self.files)

    def records(self, step: int) -> list[dict[str, Any]]:
        if step not in self.files:
            raise KeyError(step)
        return self._load(step)


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """What the trajectory list shows: enough to filter and pick, not the tokens."""
    task = record.get("task") or {}
    return {
        "traj_id": record["traj_id"],
        "group_id": record["group_id"],
        "reward": record.get("reward"),
        "termination": record.get("termination"),
        "turns": len(record.get("turns", [])),
        "question": str(task.get("question", ""))[:200],
    }


def create_app(path: str | Path):
    """The FastAPI app serving the page and its JSON API over the records at `path`."""
    from fastapi import FastAPI, HTTPException, Query
    from fastapi.responses import FileResponse

    store = TrajectoryStore(path)
    app = FastAPI(title="agent-r1 trajectory viewer")

    def records_of(step: int) -> list[dict[str, Any]]:
        try:
            return store.records(step)
        except KeyError:
            raise HTTPException(404, f"no step {step}; steps: {store.steps()}") from None

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/api/run")
    def run() -> dict[str, Any]:
        return {"name": store.path.name, "steps": store.steps()}

    @app.get("/api/trajectories")
    def trajectories(
        step: int,
        termination: str | None = None,
        min_reward: float | None = Query(None),
        max_reward: float | None = Query(None),
    ) -> dict[str, Any]:
        rows = [summary(r) for r in records_of(step)]
        terminations = sorted({str(r["termination"]) for r in rows})
        if termination:
            rows = [r for r in rows if r["termination"] == termination]
        if min_reward is not None:
            rows = [r for r in rows if r["reward"] is not None and r["reward"] >= min_reward]
        if max_reward is not None:
            rows = [r for r in rows if r["reward"] is not None and r["reward"] <= max_reward]
        return {"step": step, "terminations": terminations, "trajectories": rows}

    @app.get("/api/trajectory/{step}/{traj_id}")
    def trajectory(step: int, traj_id: str) -> dict[str, Any]:
        for r in records_of(step):
            if r["traj_id"] == traj_id:
                return r
        raise HTTPException(404, f"no trajectory {traj_id} at step {step}")

    return app


def serve_viewer(cfg: ViewConfig) -> None:
    import uvicorn

    app = create_app(cfg.run_dir)
    print(f"agent-r1 view: http://{cfg.host}:{cfg.port}/  (Ctrl-C to stop)")
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
