"""Rewards for live traffic, each with its provenance: explicit feedback, implicit signals, a judge.

* **Explicit**: a user's score (0-1) of one answer or of a whole session, posted to `/v1/feedback`.
* **Implicit**: what the user did next in the session. The next user message corrects the answer ("no,
  that's wrong", "try again") or asks the same question again (≥ 0.8 similar, difflib) → 0; anything
  else (thanks, a new question) → 1; the session's last answer, with nothing after it → none. Any
  function `(user_text, answer, next_user_text) -> float | None` can replace the rule (`implicit=pkg:fn`).
* **Judge**: a Python function `(user_text, answer) -> float` or any OpenAI-compatible model with a
  rubric, asked for a 0-10 grade. It scores what no user saw (exploration's other answers) and answers
  nobody reacted to. A judge that is down or slow leaves the answer unscored (the failure is stored and
  counted) and it is asked again later; it runs in the trainer, never in the server's path.

`session_return` turns one session's rewards into the trajectory's: the session's own score, else the
last answer's; the other answers' rewards are process rewards, so the turn-level estimators
(docs/algorithms.md) give each step its own credit.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from agent_r1.utils.imports import import_path

PRIORITY = ("explicit", "judge", "implicit")  # an answer's reward: the first source that scored it
_CORRECTION = re.compile(
    r"^\W*(no\b|nope\b|wrong\b|incorrect\b|that'?s (not|wrong|incorrect)|that is (not|wrong)|not (right|correct)|"
    r"try again\b|you'?re wrong|actually,? (it|the answer))",
    re.IGNORECASE,
)
RUBRIC = (
    "Grade the assistant's answer to the user's request for correctness and helpfulness. Reply with one "
    "integer from 0 (useless or wrong) to 10 (fully correct and helpful) and nothing else."
)


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def implicit_signal(user_text: str, answer: str, next_user_text: str | None) -> float | None:
    """The default rule (module docstring): 0 after a correction or a re-ask, 1 when the user goes on."""
    if next_user_text is None:
        return None
    if _CORRECTION.match(next_user_text):
        return 0.0
    if user_text and difflib.SequenceMatcher(None, _norm(user_text), _norm(next_user_text)).ratio() >= 0.8:
        return 0.0
    return 1.0


def implicit_rule(spec: str) -> Callable[[str, str, str | None], float | None] | None:
    """`default`, `off`, or an import path of a function with `implicit_signal`'s signature."""
    if spec == "off":
        return None
    return implicit_signal if spec == "default" else import_path(spec, "implicit")


class JudgeError(RuntimeError):
    """The judge did not give a score (down, slow, or an answer that is not a grade)."""


@dataclass
class JudgeConfig:
    function: str = ""
    """import path of a Python reward function (user_text, answer) -> score in [0, 1]"""
    url: str = ""
    """or an OpenAI-compatible server's base URL (http://host:port/v1) whose model grades with `rubric`"""
    model: str = ""
    """the judge model's name at url"""
    rubric: str = RUBRIC
    """the judge's instructions; it must answer with an integer 0-10"""
    api_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the judge server's key, if it needs one"""
    timeout_s: float = 30.0
    """seconds before a judge call counts as failed (the answer waits, unscored)"""

    def __post_init__(self) -> None:
        if self.function and self.url:
            raise ValueError("judge: give function or url, not both")
        if self.url and not self.model:
            raise ValueError("judge.url needs judge.model")
        if self.timeout_s <= 0:
            raise ValueError(f"judge.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def enabled(self) -> bool:
        return bool(self.function or self.url)


class Judge:
    """Scores one answer in [0, 1], or raises JudgeError."""

    def __init__(self, cfg: JudgeConfig) -> None:
        import os

        self.cfg = cfg
        self.fn = import_path(cfg.function, "judge.function") if cfg.function else None
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        self.client = None
        if cfg.url:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            self.client = httpx.Client(base_url=cfg.url.rstrip("/"), timeout=cfg.timeout_s, headers=headers)

    @property
    def name(self) -> str:
        return self.cfg.function or f"{self.cfg.model}@{self.cfg.url}"

    def __call__(self, user_text: str, answer: str) -> float:
        try:
            score = self.fn(user_text, answer) if self.fn is not None else self._ask(user_text, answer)
            score = float(score)
        except JudgeError:
            raise
        except Exception as exc:  # a reward function's bug or a server's failure: the answer waits
            raise JudgeError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        if not 0 <= score <= 1:
            raise JudgeError(f"the judge's score {score} is not in [0, 1]")
        return score

    def _ask(self, user_text: str, answer: str) -> float:
        assert self.client is not None
        messages = [
            {"role": "system", "content": self.cfg.rubric},
            {"role": "user", "content": f"Request:\n{user_text}\n\nAnswer:\n{answer}\n\nGrade (0-10):"},
        ]
        body = {"model": self.cfg.model, "messages": messages, "temperature": 0, "max_tokens": 8}
        reply = self.client.post("/chat/completions", json=body)
        reply.raise_for_status()
        text = reply.json()["choices"][0]["message"]["content"] or ""
        grade = re.search(r"\d+(\.\d+)?", text)
        if grade is None or not 0 <= float(grade.group()) <= 10:
            raise JudgeError(f"the judge answered {text[:60]!r}, not a grade from 0 to 10")
        return float(grade.group()) / 10

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def answer_reward(rewards: Sequence[dict[str, Any]]) -> tuple[float, str] | None:
    """(score, source) of one answer from its rewards: the latest of the first source in PRIORITY that gave one."""
    for source in PRIORITY:
        scored = [r["score"] for r in rewards if r["source"] == source and r["score"] is not None]
        if scored:
            return scored[-1], source
    return None


def session_return(
    session_scores: Sequence[float], step_rewards: Sequence[float | None]
) -> tuple[float, list[float | None]] | None:
    """(outcome, per-step process rewards) of a session: the session's latest explicit score, else the last
    scored answer's reward, which then is not also a process reward. None when nothing scored it."""
    steps = list(step_rewards)
    if session_scores:
        return session_scores[-1], steps
    scored = [i for i, r in enumerate(steps) if r is not None]
    if not scored:
        return None
    last = scored[-1]
    outcome = steps[last]
    steps[last] = None
    assert outcome is not None
    return outcome, steps
