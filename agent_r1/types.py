"""Core data types of the step-level MDP.

An episode is a list of `Step`s. Each step holds the exact prompt token ids the policy saw and the
exact token ids it sampled (with their log-probs); nothing is ever decoded and re-tokenized for
training. The environment, not string concatenation, decides the next prompt, so consecutive steps
need not extend each other; `rollout.merge` joins them into one training row when they do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# {"role": "user" | "assistant" | "system", "content": str, or a list of OpenAI-style content parts:
#  {"type": "text", "text": str} | {"type": "image", "image": PIL image, array, path or data URL}}
Message = dict[str, Any]


@dataclass(eq=False)
class Image:
    """One image of a prompt, prepared by the model's processor (agent_r1/models/vision.py).

    The prompt's ids hold `num_tokens` placeholder ids (the model's image token) for it, in the order
    the images are listed; the vision tower's features replace their embeddings. Every image's
    placeholders are the same id, so two prompts are the same prompt only when their ids *and* image
    digests agree.
    """

    digest: str  # sha256 of the decoded pixels and size: tells images apart, not their placeholders
    inputs: dict[str, Any]  # the processor's tensors for this image alone: pixel_values, image_grid_thw, ...
    num_tokens: int  # placeholder ids it takes in the prompt
    expansion: list[int]  # the ids that stand for it in the prompt (placeholders and any markers around them)
    picture: Any = None  # the PIL image, for viewers


@dataclass
class Observation:
    """What the environment shows the policy. Exactly one of the three forms is set.

    `token_ids` is the form multi-turn envs use after the first turn: the env owns the context as ids,
    so tool outputs are tokenized once, when they enter the context, and sampled ids stay exact.
    """

    messages: list[Message] | None = None  # chat messages, rendered with the chat template
    text: str | None = None  # plain text, rendered as one user turn by the prompt format
    token_ids: list[int] | None = None  # [T] the full prompt, used as is
    # the environment's state without the agent's own words (e.g. a hash of what the tools showed):
    # steps of one task's group acting from equal states form GiGPO's step groups; None = the prompt
    state: str | None = None
    images: list[Image] = field(default_factory=list)  # the images of `token_ids`, in placeholder order

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.messages, self.text, self.token_ids)]
        if sum(given) != 1:
            raise ValueError("Observation needs exactly one of messages, text or token_ids")


@dataclass
class Action:
    """What the policy produced in one step: the sampled ids are the ground truth, text is derived."""

    token_ids: list[int]  # [R] sampled ids, exactly as generated
    logprobs: list[float]  # [R] log-prob of each sampled id under the rollout policy
    text: str  # decoded token_ids, for parsing tool calls and for humans
    finish_reason: str = "stop"  # "stop" (stop string) | "eos" | "length"
    # an env that asks for several samples per step (`samples` = n, the gateway's OpenAI `n`): the other
    # n - 1, sampled from the same prompt; the step records the one the env reports taking (info["choice"])
    alternatives: list[Action] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Action has {len(self.token_ids)} ids but {len(self.logprobs)} logprobs")


class Termination(StrEnum):
    """Why a trajectory ended."""

    ANSWERED = "answered"  # the env ended the episode (the model answered)
    MAX_TURNS = "max_turns"  # the turn budget ran out
    CONTEXT_OVERFLOW = "context_overflow"  # the next prompt no longer fits the context window
    ERROR = "error"  # the env raised; the trajectory is kept for inspection, never crashes the run


@dataclass
class Step:
    """One RL transition: prompt ids -> sampled response ids, plus what the env answered."""

    prompt_ids: list[int]  # [P] exact prompt the policy saw
    response_ids: list[int]  # [R] exact sampled ids
    response_logprobs: list[float]  # [R] rollout log-probs of response_ids
    reward: float | None = None  # env reward for this step (process reward), None if none
    info: dict[str, Any] = field(default_factory=dict)  # env info (tool calls, errors, ...)
    text: str = ""  # decoded response, for parsing and viewing only
    index: int = 0  # position of the step in its trajectory
    finish_reason: str = ""  # why sampling stopped: "stop" | "eos" | "length" ("length" = truncated)
    done: bool = False  # the env ended the episode with this step: its reward is the outcome
    state: str = ""  # the env state the step acted from (Observation.state, else a digest of the prompt)
    images: list[Image] = field(default_factory=list)  # the images of prompt_ids, in placeholder order
    response_versions: list[int] | None = None  # [R] policy version that sampled each id (async RL), if tracked
    grammar: str | None = None  # the grammar the response was sampled under (EBNF), None for free text


@dataclass
class Trajectory:
    """One episode of one task sample. `group_id` ties the G samples of a task together (GRPO)."""

    task: dict[str, Any]
    traj_id: str
    group_id: str
    steps: list[Step] = field(default_factory=list)
    termination: Termination | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # message of the env exception when termination is ERROR

    @property
    def rewards(self) -> list[float]:
        """Per-step rewards, 0.0 where the env gave none."""
        return [s.reward or 0.0 for s in self.steps]

    @property
    def reward(self) -> float:
        """Total (undiscounted) reward of the episode."""
        return sum(self.rewards)

    @property
    def outcome(self) -> float:
        """The reward of the step on which the env ended the episode; 0.0 when it was cut off instead
        (turn cap, context overflow, error) and its last step was an ordinary tool step."""
        return (self.steps[-1].reward or 0.0) if self.steps and self.steps[-1].done else 0.0

    @property
    def process_rewards(self) -> list[float]:
        """Per-step rewards of every step but the one that ended the episode (which carries the outcome)."""
        return [0.0 if s.done else (s.reward or 0.0) for s in self.steps]


@dataclass
class TrainSequence:
    """One training row: a trajectory's steps merged where each prompt extends the row's context.

    Masks come from the data: sampled tokens are trainable, prompt and tool tokens are not.
    """

    traj_id: str
    group_id: str
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T] 1 on sampled tokens, 0 on prompt / tool / env tokens
    logprobs: list[float]  # [T] rollout log-prob on sampled tokens, 0.0 elsewhere
    step_index: list[int]  # [T] index of the step that sampled the token, -1 on non-sampled tokens
    images: list[Image] = field(default_factory=list)  # the images of input_ids, in placeholder order
    versions: list[int] = field(default_factory=list)  # [T] the policy version that computed the token's whole
    # step (async RL), -1 on prompt tokens and where a step spans a weight update or versions are not tracked
    parent: int = -1  # a branch of an episode's tree: the earlier row of its trajectory it shares the most with
    shared: int = 0  # ... and how many leading tokens it shares with that row (prompt here, computed once)
    grammars: dict[int, str] = field(default_factory=dict)  # step index -> the grammar its response was sampled under
