"""OpenEnv servers that misbehave, for tests/env/test_openenv.py (served by uvicorn, as users' are).

`app` is a real OpenEnv server (`create_app`) whose env does what the action's `op` says: answer, end the
episode, sleep past the client's timeout, or raise. It takes 2 sessions at once, so a third waits.
Under `/quiz` is an MCP environment (tools listed and called through step, as OpenEnv's RFC 003 has
them). Under `/raw` is a server that speaks OpenEnv's WebSocket protocol but answers with what an OpenEnv env
cannot produce (a string observation, a text reward): the malformed observations a broken or foreign
server sends.
"""

from __future__ import annotations

import json
import time

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastmcp import FastMCP
from openenv.core.env_server import (
    Action,
    CallToolAction,
    CallToolObservation,
    Environment,
    MCPEnvironment,
    Observation,
    State,
    create_app,
)
from pydantic import Field


class OpAction(Action):
    """Do one operation."""

    op: str = Field(description="ok, end, sleep or raise")
    seconds: float = 0.0


class OpObservation(Observation):
    text: str = ""


class OpEnvironment(Environment[OpAction, OpObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> OpObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return OpObservation(text=f"ready {seed}")

    def step(self, action: OpAction, timeout_s: float | None = None, **kwargs) -> OpObservation:
        self._state.step_count += 1
        if action.op == "raise":
            raise RuntimeError("the env broke on this action")
        if action.op == "sleep":
            time.sleep(action.seconds)
        return OpObservation(text=f"did {action.op} #{self._state.step_count}", reward=0.25, done=action.op == "end")

    @property
    def state(self) -> State:
        return self._state


app = create_app(OpEnvironment, OpAction, OpObservation, env_name="ops", max_concurrent_envs=2)

raw = FastAPI()


@raw.get("/schema")
def schema() -> dict:
    action = {"type": "object", "properties": {"op": {"type": "string"}, "seconds": {"type": "number"}}}
    return {"action": action, "observation": {}, "state": {}}


@raw.websocket("/ws")
async def ws(websocket: WebSocket) -> None:
    """reset: a good observation; step "text": a string where the observation object belongs; step
    "reward": a reward that is text; anything else: done with reward 1."""
    await websocket.accept()
    try:
        while True:
            message = json.loads(await websocket.receive_text())
            if message["type"] == "close":
                break
            op = message.get("data", {}).get("op")
            data = {"observation": {"text": "start"}, "reward": None, "done": False}
            if op == "text":
                data = {"observation": "not an object", "reward": 0.0, "done": False}
            elif op == "reward":
                data = {"observation": {"text": "x"}, "reward": "a lot", "done": False}
            elif op is not None:
                data = {"observation": {"text": "bye"}, "reward": 1.0, "done": True}
            await websocket.send_text(json.dumps({"type": "observation", "data": data}))
    except WebSocketDisconnect:
        pass


app.mount("/raw", raw)


class QuizEnvironment(MCPEnvironment):
    """An MCP environment (OpenEnv RFC 003): its tools are listed and called through step(). `add` is
    a plain tool; `submit` ends the episode, rewarded 1 when it is the reset's a + b."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("quiz")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two whole numbers."""
            return a + b

        @mcp.tool
        def hint() -> str:
            """A hint (this one is out of order)."""
            raise ValueError("no hints today")

        @mcp.tool
        def submit(answer: int) -> str:
            """Submit the final answer."""
            return "submitted"

        super().__init__(mcp)
        self._state, self.sum = State(step_count=0), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> Observation:
        self._state, self.sum = State(episode_id=episode_id, step_count=0), 2 * (seed or 0) + 1
        return Observation()  # MCP envs commonly show nothing at reset: the task's question is the prompt

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            observation.reward = float(action.arguments.get("answer") == self.sum)
            observation.done = True
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs) -> Observation:
        return Observation(metadata={"error": "only MCP tool calls are actions here"})

    @property
    def state(self) -> State:
        return self._state


app.mount("/quiz", create_app(QuizEnvironment, CallToolAction, CallToolObservation, env_name="quiz"))
