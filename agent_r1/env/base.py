"""The environment protocol: async reset/step over observations and actions.

A step returns the *next observation chosen by the env*: an env may append to the context (the
common case), rewrite it, or start afresh. The agent loop never assumes the context only grows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from agent_r1.types import Action, Observation, Termination


class StepResult(NamedTuple):
    """What `Env.step` returns; a plain tuple `(observation, reward, done, info)` works the same."""

    observation: Observation | None  # None once done
    reward: float | None  # reward of this step (process or outcome), None when the env gives none
    done: bool
    # "termination": Termination when done; "metrics": {name: number}, summed over the episode and logged as
    # batch means (as ToolEnv's tool_calls and tool_errors are); "step_rewards": {earlier step index: reward}
    # when done, rewards the env gives earlier steps only at the end (the gateway's scored branches); all of it
    # is kept in the trajectory records
    info: dict[str, Any]


class Env:
    """What the agent loop needs from an environment: subclass it and write `reset` and `step`; the
    optional features have their defaults here, so the loop uses them without probing. One instance
    runs one episode at a time.

    Per-step options: `info["termination"]` when done, `info["metrics"]` ({name: number}, summed over the
    episode and logged as batch means), `info["choice"]` (which of `samples` the episode went on from);
    GiGPO's step groups read `Observation.state` (default: a digest of the prompt)."""

    stop: tuple[str, ...] = ()  # extra stop strings for sampling (e.g. "</tool_call>")
    samples: int = 1  # responses sampled at each step (each its own seed); the env picks one (info["choice"])
    # the grammar the next response is sampled under (EBNF; models/grammar.py), None for free text: the step
    # records it and the trainer computes its log-probs under the same mask
    grammar: str | None = None

    async def reset(self, task: dict[str, Any]) -> Observation:
        """Start an episode for `task`; return the first observation."""
        raise NotImplementedError

    async def step(self, action: Action) -> StepResult:
        """Apply the policy's action; return the next observation, reward, done and info."""
        raise NotImplementedError

    async def close(self) -> None:
        """Free per-episode resources (processes, directories); called once the episode ends, however it
        ends."""


__all__ = ["Env", "StepResult", "Termination"]
