"""A trivially learnable toy task for trainer tests: a tiny model over a 64-token vocabulary.

Reward = share of sampled ids below 32 over a 2-turn episode. With 64 ids every token is sampled
often, so GRPO visibly moves the policy in a few steps; observations are raw ids, so the env is
token-exact by construction.
"""

from __future__ import annotations

import contextlib

import pytest
from transformers import LlamaForCausalLM

from agent_r1.config import load_config
from agent_r1.env.base import Env, StepResult
from agent_r1.trainer.config import TrainConfig
from agent_r1.types import Observation, Termination
from tests.conftest import make_tiny_llama

VOCAB = 64


class LowIdEnv(Env):
    """Two turns; the outcome reward is the share of sampled ids < 32 (NaN when `poison`)."""

    def __init__(self, poison: bool = False) -> None:
        self.poison = poison

    async def reset(self, task):
        self.turn, self.hits, self.context = 0, [], list(task["ids"])
        return Observation(token_ids=list(self.context))

    async def step(self, action):
        self.turn += 1
        self.hits += [t < VOCAB // 2 for t in action.token_ids]
        if self.turn == 2:
            reward = float("nan") if self.poison else sum(self.hits) / max(1, len(self.hits))
            return StepResult(None, reward, True, {"termination": Termination.ANSWERED})
        self.context = self.context + action.token_ids + [40, 41]  # an env observation of 2 ids
        return StepResult(Observation(token_ids=list(self.context)), None, False, {})


TASKS = [{"ids": [10 + i, 50, 51]} for i in range(16)]


class Killed(Exception):
    pass


@contextlib.contextmanager
def killed_after_logging(monkeypatch, step: int):
    """The run dies right after it logged `step` (a kill between checkpoints); the logger is whole again after."""
    import agent_r1.observe.loggers as loggers

    real_log = loggers.Loggers.log

    def log_then_die(self, metrics, logged):
        real_log(self, metrics, logged)
        if logged == step:
            raise Killed

    monkeypatch.setattr(loggers.Loggers, "log", log_then_die)
    with pytest.raises(Killed):
        yield
    monkeypatch.setattr(loggers.Loggers, "log", real_log)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    return make_tiny_llama(VOCAB, hidden=32, seed=seed)


def toy_config(tmp_path, *overrides: str) -> TrainConfig:
    base = [
        f"run_dir={tmp_path / 'run'}",
        "steps=4",
        "optim.lr=1e-2",
        "rollout.tasks_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=6",
        "prompt_format=chat",
    ]
    return load_config(TrainConfig, None, [*base, *overrides])


@pytest.fixture
def toy():
    """(model factory, env factory, tasks)"""
    return tiny_model, LowIdEnv, TASKS
