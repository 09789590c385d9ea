"""OpenEnv environments as a task: any OpenEnv server, by URL or by the import path of its app.

    agent-r1 train task=openenv task.app=my_envs.server.app:app      # started here (uvicorn, 127.0.0.1)
    agent-r1 eval  task=openenv task.url=http://host:8000            # a server that is already running

Episodes run through OpenEnv's own client (`openenv-core`), one session each (agent_r1/env/openenv.py):
the env's reset observation is the prompt, its action is a tool the model calls (or, with
`task.action_field`, the model's whole text), and its rewards are the steps' rewards. The env makes its
own tasks: the tasks here are reset seeds, split by the same hash buckets as every generated task, or
the rows of `task.data` (each row's fields are reset's arguments). Nothing here is special to a trainer:
this file is the whole adapter's task side.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from dataclasses import dataclass
from typing import Any

from agent_r1.data import load_tasks
from agent_r1.data.splits import Split, split_of
from agent_r1.env.openenv import OpenEnvEnv, generic_client, local_server
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.tools.base import TOOL_NAME_RE


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
