"""An OpenEnv environment written as OpenEnv's own docs write one: guess a hidden number in few tries.

Serve it and train on it with agent-r1 (the adapter starts it on 127.0.0.1 for you):

    agent-r1 train task=openenv task.app=examples.openenv_guess:app
    uvicorn examples.openenv_guess:app --port 8000     # or run it yourself ...
    agent-r1 eval task=openenv task.url=http://127.0.0.1:8000   # ... and point any client at it

Nothing here knows about agent-r1: it is an `openenv.core` Environment served by `create_app`, so any
OpenEnv client (TRL's, SkyRL's, prime-rl's) can use it too. `reset(seed)` hides a number in
[1, high]; each action guesses one; the observation says lower, higher or correct. The reward is 1 for
the step that finds it; the episode ends then or after `tries` guesses.
"""

from __future__ import annotations

import random
import uuid

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field


class GuessAction(Action):
    """Guess the hidden number."""

    number: int = Field(description="your guess, a whole number")


class GuessObservation(Observation):
    message: str = Field(description="what the game says about the last guess")


class GuessState(State):
    secret: int = 0
    high: int = 100


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    """Guess a number in [1, high] in at most `tries` guesses; each answer says higher or lower."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance and no shared state

    def __init__(self, high: int = 100, tries: int = 8) -> None:
        super().__init__()
        self.high, self.tries = high, tries
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        secret = random.Random(seed).randint(1, self.high)
        self._state = GuessState(episode_id=episode_id or uuid.uuid4().hex, step_count=0, secret=secret, high=self.high)
        return GuessObservation(message=f"I am thinking of a number from 1 to {self.high}. Guess it.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        left = self.tries - self._state.step_count
        if action.number == self._state.secret:
            return GuessObservation(message="Correct!", reward=1.0, done=True)
        hint = "higher" if action.number < self._state.secret else "lower"
        return GuessObservation(message=f"No, it is {hint} than {action.number}.", reward=0.0, done=left <= 0)

    @property
    def state(self) -> GuessState:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess_number", max_concurrent_envs=64)
