"""OpenEnv environments as a task: any OpenEnv server, by URL or by the import path of its app.

    agent-r1 train task=openenv task.app=my_envs.server.app:app      # started here (uvicorn, 127.0.0.1)
    agent-r1 eval  task=openenv task.url=http://host:8000            # a server that is already running

Episodes run through OpenEnv's own client (`openenv-core`), one session each (`OpenEnvEnv`, below):
the env's reset observation is the prompt, its action is a tool the model calls (or, with
`task.action_field`, the model's whole text), and its rewards are the steps' rewards. The env makes its
own tasks: the tasks here are reset seeds, split by the same hash buckets as every generated task, or
the rows of `task.data` (each row's fields are reset's arguments). Nothing here is special to a trainer:
this module is the whole adapter.

The env, `OpenEnvEnv`, runs an OpenEnv environment server (`openenv-core`) as an agent-r1 env, through
OpenEnv's own client.

An OpenEnv env is a server (`openenv.core.env_server.create_app`) whose sessions are WebSocket
connections: `reset(seed, ...)` gives an observation; `step(action)` gives the next one with a reward and
`done`. The action is a pydantic model whose JSON schema the server publishes (`GET /schema`). Each
episode here is one session of `GenericEnvClient`, closed when the episode ends.

The policy acts in one of two ways:
- **tool** (default): the action schema is one function tool (`tool_name`). The model writes the call in
  its family's syntax (`tool_formats`) like any tool call, and the observation is the tool's result. The
  composed `ToolEnv` does the prompt, the parsing and the results turn, so an OpenEnv episode's tokens
  are built exactly as every other tool episode's. An MCP environment (OpenEnv RFC 003, whose action is
  `CallToolAction`) offers its own tools instead, listed at reset and each called through `step`. A
  turn without a call ends the episode.
- **text** (`action_field`): the whole response is that string field of the action (text games, where
  the action is the message), and the observation is the next user turn.

Rewards are per step (the reward of the step an action caused, as the env reports it; the return is
their sum, DESIGN.md §1). The episode ends when the env says done or after `max_turns` actions. What goes
wrong on the server side never crashes a run: an action the server rejects, an env that raises in
`step` and a malformed observation become error observations the model reads (counted as tool errors
`invalid_action`, `env_error`, `malformed_observation`); a server that is down, closes the session or
answers slower than `timeout_s` ends the episode as errored (counted by the trainer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent_r1.data import load_tasks
from agent_r1.data.splits import Split, split_of
from agent_r1.env.base import Env, StepResult
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_env import ToolEnv, truncate_to_tokens
from agent_r1.tools import Tool, ToolResult
from agent_r1.tools.base import TOOL_NAME_RE
from agent_r1.types import Action, Observation, Termination
from agent_r1.utils import servers
from agent_r1.utils.servers import stop_local_servers  # noqa: F401 (re-exported: the tests stop them)

INSTALL = "pip install openenv-core==0.3.0"
HIDDEN = ("done", "reward", "metadata")  # observation fields that are the env's bookkeeping, not shown
_SCHEMAS: dict[str, dict[str, Any]] = {}  # server URL -> its action schema, fetched once per process


def generic_client() -> type:
    """OpenEnv's dict-based client (no env package needed on this side), or a one-line install hint."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError:
        raise ImportError(f"task=openenv needs openenv-core: {INSTALL}") from None
    return GenericEnvClient


class EnvServerError(RuntimeError):
    """The server is unreachable, closed the session or answered too slowly: the episode cannot go on."""


class OpenEnvEnv(Env):
    """One episode of an OpenEnv server's env; the policy acts by a tool call or by its text."""

    def __init__(
        self,
        url: str | Callable[[], str],
        prompt_format: PromptFormat,
        *,
        action_field: str | None = None,
        observation_field: str | None = None,
        tool_name: str = "act",
        instructions: str = "",
        max_turns: int = 8,
        timeout_s: float = 60.0,
        session_wait_s: float = 300.0,
        max_observation_tokens: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        # a callable starts (or restarts) a local server: called off the event loop when the episode resets,
        # since starting one waits seconds, and every other episode of the loop would wait with it
        self.server = None if isinstance(url, str) else url
        self.url = url.rstrip("/") if isinstance(url, str) else ""
        self.format = prompt_format
        self.action_field = action_field
        self.observation_field = observation_field
        self.tool_name = tool_name
        self.instructions = instructions
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self.session_wait_s = session_wait_s  # how long to wait for a session of a server at its capacity
        self.max_observation_tokens = max_observation_tokens
        calls = prompt_format.tool_format.stop if action_field is None else ()  # a call turn ends at its stop
        self.stop = (*calls, *prompt_format.stop)
        self.client: Any = None
        self.tools: ToolEnv | None = None

    # -- the episode ---------------------------------------------------------------------------------

    async def reset(self, task: dict[str, Any]) -> Observation:
        """Open a session and reset the env with the task's fields as reset's arguments (`seed`, ...)."""
        self.turn, self.done, self.broken = 0, False, None
        self.shown: list[str] = []  # every observation shown so far (the state GiGPO groups steps by)
        self._lock = asyncio.Lock()  # one env step at a time, even when a turn holds several calls
        if self.server is not None:
            self.url = (await asyncio.to_thread(self.server)).rstrip("/")
        first = await self._open(task)
        shown, _ = self._shown(first)  # a malformed first observation is an errored episode
        # the task's question (a data row's) comes first; MCP envs often show nothing at reset
        text = "\n\n".join(part for part in (str(task.get("question") or ""), shown) if part)
        if not text:
            raise ValueError("the env's reset observation is empty and the task has no question to ask")
        if self.action_field is None:
            schema = await self._action_schema()
            tools = await self._mcp_tools() if _is_mcp(schema) else [self._action_tool(schema)]
            # the turn cap is ours (every action runs, the last one too), so the ToolEnv gets one more
            self.tools = ToolEnv(
                {t.name: t for t in tools},
                self.format,
                instructions=self.instructions,
                max_turns=self.max_turns + 1,
                max_tool_tokens=self.max_observation_tokens,
            )
            return await self.tools.reset({"question": text})
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        self.context = self.format.initial([*system, {"role": "user", "content": text}])
        return self._observation()

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.tools is not None:
            result = await self.tools.step(action)
            if self.broken is not None:
                raise self.broken
            if result.done:
                return result
            obs, reward, info = result.observation, result.reward, result.info
        else:
            text = action.text
            for stop in self.format.stop:  # a base model that went on to write the next turn
                text = text.split(stop)[0]
            out = await self._step({self.action_field: text})
            if self.broken is not None:
                raise self.broken
            info = {"tool_errors": {out.error: 1} if out.error else {}}
            reward, obs = out.reward, None
            if not self.done and self.turn < self.max_turns:
                turn = [{"role": "user", "content": out.output}]
                self.context = (
                    self.context
                    + action.token_ids
                    + self.format.continuation(turn, after_eos=action.finish_reason == "eos")
                )
                obs = self._observation()
        if self.done:
            return StepResult(None, reward, True, info | {"termination": Termination.ANSWERED})
        if self.turn >= self.max_turns:
            return StepResult(None, reward, True, info | {"termination": Termination.MAX_TURNS})
        return StepResult(obs, reward, False, info)

    async def close(self) -> None:
        """End the session (the server frees the env instance); a server that does not answer the
        close within a second (busy in a step that timed out) is left to drop it."""
        if self.client is not None:
            client, self.client = self.client, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), timeout=1.0)

    def _observation(self) -> Observation:
        state = hashlib.sha1(json.dumps(self.shown).encode()).hexdigest()[:16]
        return Observation(token_ids=list(self.context), state=state)

    # -- the server ----------------------------------------------------------------------------------

    async def _open(self, task: dict[str, Any]) -> Any:
        """A new session, reset with the task. A server at its session capacity (`max_concurrent_envs`)
        refuses the session, with CAPACITY_REACHED or by closing it at once; that is retried, backing
        off, for up to `session_wait_s`. A server that refuses connections or does not answer is not."""
        from websockets.exceptions import ConnectionClosed

        client_cls = generic_client()
        deadline = time.monotonic() + self.session_wait_s
        delay = 0.02
        while True:
            self.client = client_cls(self.url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s)
            try:
                return await self.client.reset(**task)
            except (RuntimeError, ConnectionClosed) as exc:
                await self.close()
                full = isinstance(exc, ConnectionClosed) or "CAPACITY_REACHED" in str(exc)
                if not full or time.monotonic() > deadline:
                    raise EnvServerError(f"OpenEnv server {self.url} gave no session: {exc!r}") from None
            except (OSError, TimeoutError) as exc:
                await self.close()
                raise EnvServerError(f"OpenEnv server {self.url} did not answer reset: {exc!r}") from None
            await asyncio.sleep(delay * (0.5 + random.random()))  # jittered: waiting episodes do not retry in step
            delay = min(delay * 2, 1.0)

    async def _action_schema(self) -> dict[str, Any]:
        """The action's JSON schema from the server's /schema (once per server and process)."""
        if self.url not in _SCHEMAS:
            import httpx

            try:
                async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                    response = await http.get(f"{_http(self.url)}/schema")
                    response.raise_for_status()
                    _SCHEMAS[self.url] = response.json()["action"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                raise EnvServerError(f"OpenEnv server {self.url}: no action schema at /schema ({exc!r})") from None
        return _SCHEMAS[self.url]

    def _action_tool(self, schema: dict[str, Any]) -> Tool:
        """The env's action as one function tool: the action schema's fields (less OpenEnv's `metadata`)
        are its parameters, the action's docstring its description."""
        properties = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        if required := [k for k in schema.get("required", []) if k in properties]:
            parameters["required"] = required
        if "$defs" in schema:
            parameters["$defs"] = schema["$defs"]
        description = schema.get("description") or f"Act in the environment ({schema.get('title', 'action')})."
        # the server's reply is awaited for timeout_s by the client itself; the tool's own timeout is a backstop
        return Tool(self.tool_name, description, parameters, self._act, timeout=self.timeout_s + 5.0)

    async def _mcp_tools(self) -> list[Tool]:
        """An MCP environment's tools (OpenEnv RFC 003: listed and called through step), each offered
        to the model as itself; a name the model could not call is left out."""
        try:
            listed = (await self.client.step({"type": "list_tools"})).observation["tools"]
            specs = [(t["name"], t.get("description") or t["name"], t.get("input_schema") or {}) for t in listed]
        except (RuntimeError, KeyError, TypeError) as exc:
            raise EnvServerError(f"OpenEnv server {self.url}: its MCP tools could not be listed ({exc!r})") from None
        tools = [
            Tool(name, description, schema, functools.partial(self._call, name), timeout=self.timeout_s + 5.0)
            for name, description, schema in specs
            if isinstance(name, str) and TOOL_NAME_RE.match(name)
        ]
        if not tools:
            raise EnvServerError(f"OpenEnv server {self.url} lists no MCP tool a model can call")
        return tools

    async def _act(self, **action: Any) -> ToolResult:
        return await self._step(action)

    async def _call(self, tool: str, /, **arguments: Any) -> ToolResult:
        return await self._step({"type": "call_tool", "tool_name": tool, "arguments": arguments})

    async def _step(self, action: dict[str, Any]) -> ToolResult:
        """One env step. What the model or the env got wrong is an error observation; a session that
        cannot go on is recorded in `self.broken`, which `step` raises once the turn is over."""
        async with self._lock:
            if self.done:
                return ToolResult("Error: the episode is over; this action was not taken.", error="episode_over")
            try:
                result = await self.client.step(action)
            except RuntimeError as exc:  # the server's error reply; the session stays open
                kind = "invalid_action" if "VALIDATION_ERROR" in str(exc) else "env_error"
                if "SESSION_ERROR" in str(exc):
                    self.broken = EnvServerError(f"OpenEnv server {self.url}: {exc}")
                return ToolResult(f"Error: {exc}", error=kind)
            except Exception as exc:  # connection closed or refused, no reply within timeout_s
                self.broken = EnvServerError(f"OpenEnv server {self.url} failed a step: {exc!r}")
                return ToolResult(f"Error: {exc!r}", error="env_error")
            try:
                text, error = self._shown(result)
            except ValueError as exc:
                return ToolResult(f"Error: {exc}", error="malformed_observation")
            self.done = result.done
            return ToolResult(text, reward=None if result.reward is None else float(result.reward), error=error)

    def _shown(self, result: Any) -> tuple[str, str | None]:
        """The observation as the model reads it, and the error kind of an MCP tool's failure (else None).
        Shown: an MCP call's result text, the chosen field, the only field, or every field as JSON (less
        done/reward/metadata). Raises ValueError on what is not an OpenEnv observation."""
        observation, reward, done = result.observation, result.reward, result.done
        if not isinstance(observation, dict):
            raise ValueError(f"the env's observation is not an object: {_cut(observation)}")
        if reward is not None and (not isinstance(reward, int | float) or not math.isfinite(reward)):
            raise ValueError(f"the env's reward is not a number: {_cut(reward)}")
        if not isinstance(done, bool):
            raise ValueError(f"the env's done is not true/false: {_cut(done)}")
        fields = {k: v for k, v in observation.items() if k not in HIDDEN}
        error = None
        if "tool_name" in fields and fields.keys() <= {"tool_name", "result", "error"}:  # CallToolObservation
            value, error = _mcp_result(fields)
        elif self.observation_field is not None:
            if self.observation_field not in fields:
                raise ValueError(f"the observation has no field {self.observation_field!r} (it has {sorted(fields)})")
            value = fields[self.observation_field]
        elif len(fields) == 1:
            (value,) = fields.values()
        else:
            value = fields or ""
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        if self.action_field is not None and self.max_observation_tokens is not None:
            text = truncate_to_tokens(text, self.format.tokenizer, self.max_observation_tokens)[0]
        self.shown.append(text)
        return text, error


def _is_mcp(schema: dict[str, Any]) -> bool:
    """Whether the server's action is an MCP tool call (an MCP environment's `CallToolAction`)."""
    return {"tool_name", "arguments"} <= set(schema.get("properties", {}))


def _mcp_result(fields: dict[str, Any]) -> tuple[str, str | None]:
    """A CallToolObservation's text: the tool's text content, or its error's message (kind tool_error)."""
    if isinstance(error := fields.get("error"), dict):
        return f"Error: {error.get('message', error)}", "tool_error"
    result = fields.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("content"), list):
        return json.dumps(result, ensure_ascii=False, default=str), None
    text = "\n".join(c.get("text", "") for c in result["content"] if isinstance(c, dict) and c.get("type") == "text")
    return (f"Error: {text}", "tool_error") if result.get("is_error") else (text, None)


def _http(url: str) -> str:
    """The server's HTTP base URL (the client takes ws:// or http://; /schema is plain HTTP)."""
    return "http" + url[2:] if url.startswith("ws") else url


def _cut(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def local_server(app: str, startup_s: float = 60.0) -> str:
    """The URL of `app` (`pkg.module:app`, an OpenEnv FastAPI app, imported from the working directory)
    served by uvicorn on 127.0.0.1, started on first use in this process and stopped when it exits
    (agent_r1/utils/servers.py). An app that cannot start is a one-line error with the last line it printed."""

    def command(port: int) -> list[str]:
        uvicorn = [sys.executable, "-m", "uvicorn", app, "--app-dir", os.getcwd(), "--log-level", "warning"]
        return [*uvicorn, "--host", "127.0.0.1", "--port", str(port)]

    return servers.local_server(app, command, f"OpenEnv app {app}", startup_s)


@dataclass
class Options:
    url: str | None = None
    """a running OpenEnv server: http://host:port (or ws://)"""
    app: str | None = None
    """or its app as pkg.module:app, served here by uvicorn on 127.0.0.1 (one server per process)"""
    action_field: str | None = None
    """act by text: the whole response is this string field of the action; none: the action is a tool"""
    observation_field: str | None = None
    """show only this field of each observation (default: the only field, or all as JSON)"""
    tool_name: str = "act"
    """the name the action's tool has for the model"""
    instructions: str = ""
    """a system prompt (in tool mode, after the tool's description)"""
    data: str | None = None
    """jsonl of reset arguments ({"seed": 3, ...}), the same rows for every split; none: seeds"""
    timeout_s: float = 60.0
    """seconds the server may take to answer a reset or a step before the episode is an error"""
    session_wait_s: float = 300.0
    """seconds an episode waits for a session while the server is at its capacity (max_concurrent_envs)"""
    max_observation_tokens: int | None = None
    """each observation is cut to this many tokens (none: no cut)"""

    def __post_init__(self) -> None:
        if (self.url is None) == (self.app is None):
            raise ValueError("task=openenv needs exactly one of task.url (a running server) or task.app (pkg.mod:app)")
        if self.url is not None and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"task.url must start with http://, https://, ws:// or wss://, got {self.url!r}")
        if self.app is not None:
            module, _, attr = self.app.partition(":")
            if not module or not attr:
                raise ValueError(f"task.app must be pkg.module:app (an OpenEnv FastAPI app), got {self.app!r}")
            if _find(module) is None:
                raise ValueError(f"task.app {self.app!r}: no module {module!r} importable from here")
        if not self.timeout_s > 0 or not self.session_wait_s >= 0:
            raise ValueError("task.timeout_s must be > 0 and task.session_wait_s >= 0")
        if not TOOL_NAME_RE.match(self.tool_name):
            raise ValueError(f"task.tool_name {self.tool_name!r} must match {TOOL_NAME_RE.pattern}")
        if self.max_observation_tokens is not None and self.max_observation_tokens < 1:
            raise ValueError(f"task.max_observation_tokens must be >= 1, got {self.max_observation_tokens}")
        generic_client()  # a missing openenv-core is one line with the install command, before any episode


def _find(module: str) -> Any:
    """The module's spec, or None (a module inside a missing package is None too, not an exception)."""
    try:
        return importlib.util.find_spec(module)
    except ImportError:
        return None


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` rows of `task.data`, or `n` reset seeds of the split: seed s is in the split its
    hash bucket names (agent_r1.data.splits), so train, val and test never share an episode; `seed`
    starts the count elsewhere, for a different draw."""
    if options.data:
        return load_tasks(options.data, required=())[:n]
    seeds = (s for s in itertools.count(seed * 1_000_003) if split_of(f"seed {s}") == split)
    return [{"seed": s} for s in itertools.islice(seeds, n)]


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 8) -> OpenEnvEnv:
    """One session of the server, started here first if it is given as an app."""
    url = options.url if options.url is not None else functools.partial(local_server, options.app)
    return OpenEnvEnv(
        url,
        prompt_format,
        action_field=options.action_field,
        observation_field=options.observation_field,
        tool_name=options.tool_name,
        instructions=options.instructions,
        max_turns=max_turns,
        timeout_s=options.timeout_s,
        session_wait_s=options.session_wait_s,
        max_observation_tokens=options.max_observation_tokens,
    )
