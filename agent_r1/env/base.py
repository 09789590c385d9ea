"""The environment protocol: async reset/step over observations and actions.

A step returns the *next observation chosen by the env*: an env may append to the context (the
common case), rewrite it, or start afresh. The agent loop never assumes the context only grows.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from agent_r1.types import Action, Observation, Termination


class StepResult(NamedTuple):
    """What `Env.step` returns; a plain tuple `(observation, reward, done, info)` works the same."""

    observation: Observation | None  # None once done
    reward: float | None  # reward of this step (process or outcome), None when the env gives none
    done: bool
    # "termination": Termination when done; "metrics": {name: number}, summed over the episode and logged as
    # batch means (as ToolEnv's tool_calls and tool_errors are); all of it is kept in the trajectory records
    info: dict[str, Any]


class Env(Protocol):
    """What the agent loop needs from an environment. One instance runs one episode at a time."""

    stop: tuple[str, ...]  # extra stop strings for sampling (e.g. "</tool_call>")

    async def reset(self, task: dict[str, Any]) -> Observation:
        """Start an episode for `task`; return the first observation."""
        ...

    async def step(self, action: Action) -> StepResult:
        """Apply the policy's action; return the next observation, reward, done and info."""
        ...

    # Optional: `async def close(self) -> None`, called once the episode ends however it ends, to free
    # per-episode resources (processes, directories). The loop calls it when the env has it.


__all__ = ["Env", "StepResult", "Termination"]
