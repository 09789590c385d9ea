"""Context management: what the model sees once an episode's history outgrows a token budget.

In the step-level MDP the environment decides each next observation (docs/architecture.md), so the
context need not only grow. `ContextConfig` is `task.context.*` for any task whose env is a `ToolEnv`:

- `append`: the context only grows; an episode whose next prompt passes the budget ends as
  `context_overflow` (with `budget=0`, at the engine's `max_context`, as always).
- `truncate`: the oldest turns are dropped (a sliding window after the system prompt and task).
- `elide`: the oldest tool outputs are replaced by a marker, the model's own turns kept ("observation
  masking": Lindenbauer et al. 2025, "The Complexity Trap"); turns are dropped only if that is not enough.
- `summarize`: before the budget is reached, the model is asked for a summary of its work. That summary
  is a sampled step, trained like any other; the episode goes on from system + task + summary (ReSum:
  Wu et al. 2025; MEM1: Zhou et al. 2025 learn the same consolidation with RL).
- `memory`: a `note` tool the model writes to; its notes are shown after the task in every prompt and
  the history beyond the last `keep_turns` turns is dropped (MemGPT: Packer et al. 2023).

Every prompt a managed context shows is at most `budget` tokens. A prompt that does not extend the
previous step's prompt and response starts a new training row (rollout/merge.py); a rewrite brings the
context down to `keep` x budget, so the turns after it are appended and share one row until the budget
is reached again. A row is at most budget + one response long: an episode's compute grows linearly with
its turns, whatever the strategy (docs/context.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from agent_r1.env.prompt_format import PromptFormat
from agent_r1.tools.base import Tool, tool
from agent_r1.types import Message

STRATEGIES = ("append", "truncate", "elide", "summarize", "memory")
SUMMARY_REQUEST = (
    "Your context is full. Write a summary of your work so far: every fact you found that the task "
    "needs and what is left to do. The history will be replaced by your summary, so include all you "
    "will need. Write it inside <summary></summary> and call no tool."
)
ELIDED = "[tool output elided"
MEMO_TOKENS = 32  # the words around a summary or a note list, and the dropped-turns line, at most
_SUMMARY = re.compile(r"<summary>(.*?)(?:</summary>|$)", re.DOTALL)


@dataclass
class ContextConfig:
    """`task.context.*`: how an episode's context is kept within a budget (docs/context.md)."""

    strategy: Literal["append", "truncate", "elide", "summarize", "memory"] = "append"
    """append, truncate, elide, summarize or memory (this module's docstring)"""
    budget: int = 0
    """most tokens of any prompt the model sees; 0 = the engine's max_context (append only)"""
    keep: float = 0.75
    """a rewrite brings the context down to this share of the budget; the turns after it append"""
    keep_turns: int = 2
    """memory: the latest turns shown whole (older ones are dropped: the notes carry them)"""
    summary_tokens: int = 256
    """the longest summary or note kept; a longer one is cut (and, for a summary, penalised)"""
    summary_penalty: float = 0.1
    """the reward of a summary step that is empty, too long or calls a tool is minus this"""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"task.context.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.budget < 0:
            raise ValueError(f"task.context.budget must be >= 0, got {self.budget}")
        if self.strategy != "append" and self.budget == 0:
            raise ValueError(f"task.context.strategy={self.strategy} needs task.context.budget > 0")
        if not 0 < self.keep <= 1:
            raise ValueError(f"task.context.keep must be in (0, 1], got {self.keep}")
        if self.keep_turns < 1 or self.summary_tokens < 1:
            raise ValueError("task.context.keep_turns and task.context.summary_tokens must be >= 1")

    @property
    def managed(self) -> bool:
        return self.strategy != "append" or self.budget > 0


class ContextOverflow(Exception):
    """The next prompt passes an `append` context's budget: the episode ends as context_overflow."""


class ManagedContext:
    """One episode's context under a strategy: the fixed head (system, examples, task), the turns still
    shown, and what stands for the rest (a dropped-turns marker, the summary, the notes)."""

    def __init__(self, cfg: ContextConfig, fmt: PromptFormat, head: list[Message]) -> None:
        self.cfg, self.fmt, self.head = cfg, fmt, list(head)
        self.turns: list[list[Message]] = []  # [assistant message, its results...] per turn shown
        self.dropped = 0  # turns no longer shown
        self.elided = 0  # tool outputs replaced by a marker
        self.summary: str | None = None
        self.notes: list[str] = []
        self.noted = False  # a note was written since the last prompt
        self.awaiting_summary = False  # the last prompt asked for a summary
        n = len(fmt.initial(head))
        reserve = 0  # what a prompt always holds beyond the head: the memo, a summary or a note, the request
        if cfg.strategy in ("summarize", "memory"):
            reserve = cfg.summary_tokens + MEMO_TOKENS
        # the request's tokens and the few that join it to the last results
        self.request_tokens = len(fmt.tokenizer.encode(SUMMARY_REQUEST, add_special_tokens=False)) + 4
        self.longest = 0  # the longest turn so far (response and results), in tokens
        if cfg.strategy == "summarize":
            reserve += self.request_tokens
        if cfg.budget and n + reserve >= cfg.budget:
            extra = f" plus {reserve} for task.context.summary_tokens={cfg.summary_tokens} and its frame"
            extra = extra if reserve else ""
            raise ValueError(
                f"task.context.budget={cfg.budget} leaves no room: the system prompt and task take {n} tokens{extra}"
            )

    # --- what the model sees ------------------------------------------------------------------------

    def view(self, request: bool = False) -> list[Message]:
        """The messages of the next prompt: head (its task message followed by the memo), the turns shown,
        and with `request`, the summary request after the last turn's results."""
        head = list(self.head)
        if memo := self._memo():
            last = head[-1]
            if last["role"] == "user" and isinstance(last.get("content"), str):
                head[-1] = {**last, "content": f"{last['content']}\n\n{memo}"}
            else:
                head.append({"role": "user", "content": memo})
        messages = head + [m for turn in self.turns for m in turn]
        if request:
            last = messages[-1]
            if last["role"] == "user" and isinstance(last.get("content"), str):
                messages[-1] = {**last, "content": f"{last['content']}\n\n{SUMMARY_REQUEST}"}
            else:
                messages.append({"role": "user", "content": SUMMARY_REQUEST})
        return messages

    def _memo(self) -> str:
        """What stands after the task for what is no longer shown."""
        if self.summary is not None:
            return f"Summary of your work so far:\n{self.summary}"
        parts = []
        if self.notes:
            parts.append("Your notes:\n" + "\n".join(f"{i}. {n}" for i, n in enumerate(self.notes, 1)))
        if self.dropped:
            parts.append(f"[{self.dropped} earlier turns are not shown: the context holds {self.cfg.budget} tokens]")
        return "\n\n".join(parts)

    def tokens(self, messages: list[Message]) -> int:
        return len(self.fmt.initial(messages))

    # --- after a turn -------------------------------------------------------------------------------

    def after_turn(self, turn: list[Message], appended: int, before: int) -> list[Message] | None:
        """Record a turn (the assistant's message and its results). Returns the next prompt's messages when
        the context is rewritten, None when the turn is appended token for token (`appended` long; the
        context was `before` long). Raises ContextOverflow for an `append` context past its budget."""
        self.turns.append(turn)
        self.longest = max(self.longest, appended - before)
        cfg = self.cfg
        if cfg.strategy == "memory" and (self.noted or len(self.turns) > cfg.keep_turns or appended > cfg.budget):
            self.noted = False
            self._drop(len(self.turns) - cfg.keep_turns)
            return self._fit(int(cfg.keep * cfg.budget))
        if cfg.strategy == "summarize" and appended + self.request_tokens + self.longest > cfg.budget:
            # asked while the request still fits: one more turn as long as the longest so far might not,
            # and eliding outputs to make room would hide what the summary must keep
            self.awaiting_summary = True
            return self._fit(cfg.budget, request=True)
        if appended <= cfg.budget:
            return None
        if cfg.strategy == "append":
            raise ContextOverflow(f"the next prompt has {appended} tokens, past task.context.budget={cfg.budget}")
        return self._fit(int(cfg.keep * cfg.budget))

    def take_summary(self, text: str) -> tuple[list[Message], list[str]]:
        """The model's answer to the summary request becomes the summary (the text inside <summary>, else
        all of it), cut to `summary_tokens`; the history it stands for is dropped. Returns the next
        prompt's messages and what was wrong with the summary (empty, too long, a tool call)."""
        self.awaiting_summary = False
        found = _SUMMARY.search(text)
        summary = (found.group(1) if found else text).strip()
        problems = []
        if "<tool_call>" in summary or self.fmt.tool_format.parse(text, {}):
            problems.append("tool_call")
            summary = summary.split("<tool_call>")[0].strip()
        ids = self.fmt.tokenizer.encode(summary, add_special_tokens=False)
        if len(ids) > self.cfg.summary_tokens:
            problems.append("too_long")
            summary = self.fmt.tokenizer.decode(ids[: self.cfg.summary_tokens])
        if not summary:
            problems.append("empty")
            summary = "(no summary)"
        self.summary = summary
        self.dropped += len(self.turns)
        self.turns = []
        return self._fit(self.cfg.budget), problems

    def note(self, text: str) -> str:
        """The memory strategy's `note` tool: keep a note (cut to `summary_tokens`) for every later prompt."""
        ids = self.fmt.tokenizer.encode(text.strip(), add_special_tokens=False)
        cut = len(ids) > self.cfg.summary_tokens
        self.notes.append(self.fmt.tokenizer.decode(ids[: self.cfg.summary_tokens]) + (" ..." if cut else ""))
        self.noted = True
        cut_note = f" It was cut to {self.cfg.summary_tokens} tokens." if cut else ""
        return f"Noted ({len(self.notes)} notes).{cut_note}"

    # --- making it fit ------------------------------------------------------------------------------

    def _drop(self, n: int) -> None:
        """Stop showing the `n` oldest turns (never the newest)."""
        n = max(0, min(n, len(self.turns) - 1))
        self.turns, self.dropped = self.turns[n:], self.dropped + n

    def _fit(self, target: int, request: bool = False) -> list[Message]:
        """The next prompt's messages, brought down to `target` tokens by taking from the older turns (their
        tool outputs elided, except under truncate, then the turns dropped). Only while the prompt is
        over the budget does it go further: the newest turn's outputs cut, then that turn dropped, then
        the oldest notes. Raises ContextOverflow if even the head cannot fit (the start-up check makes that
        a misconfiguration)."""
        while True:
            messages = self.view(request)
            n = self.tokens(messages)
            if n <= target:
                return messages
            if self._shrink_older():
                continue
            if n <= self.cfg.budget:
                return messages
            if not self._shrink_newest():
                raise ContextOverflow(f"{n} tokens with every turn dropped, past task.context.budget={self.cfg.budget}")

    def _shrink_older(self) -> bool:
        """Elide the oldest tool output of a turn before the newest (not under truncate: a short one is left
        as it is), else drop the oldest turn; False when there is no older turn."""
        if self.cfg.strategy != "truncate":
            for turn in self.turns[:-1]:
                for i, m in enumerate(turn[1:], 1):
                    content = m.get("content")
                    if isinstance(content, str) and not content.startswith(ELIDED) and self._length(content) > 16:
                        turn[i] = _elided(m, self.fmt)
                        self.elided += 1
                        return True
        if len(self.turns) > 1:
            self._drop(1)
            return True
        return False

    def _shrink_newest(self) -> bool:
        """Halve the newest turn's longest text output, else drop that turn, else the oldest note."""
        if self.turns:
            newest = self.turns[0]
            for i, m in enumerate(newest[1:], 1):
                content = m.get("content")
                if isinstance(content, str) and (n := self._length(content)) > 16:
                    ids = self.fmt.tokenizer.encode(content, add_special_tokens=False)
                    newest[i] = {**m, "content": self.fmt.tokenizer.decode(ids[: n // 2]) + " ...[cut]"}
                    return True
            self.turns, self.dropped = [], self.dropped + 1
            return True
        if self.notes:
            self.notes.pop(0)
            return True
        return False

    def _length(self, text: str) -> int:
        return len(self.fmt.tokenizer.encode(text, add_special_tokens=False))

    def info(self) -> dict[str, Any]:
        """What the step's record shows about the context (the trajectory viewer)."""
        return {"strategy": self.cfg.strategy, "turns_shown": len(self.turns), "dropped": self.dropped,
                "elided": self.elided, "notes": len(self.notes), "summary": self.summary}  # fmt: skip


def note_tool(write: Callable[[str], str]) -> Tool:
    """The memory strategy's tool; `write` keeps the note (the episode's `ManagedContext.note`)."""

    @tool
    def note(text: str) -> str:
        """Write a note that stays in your context after older turns are dropped.

        Args:
            text: The facts to keep, in a few words.
        """
        return write(text)

    return note


def _elided(message: Message, fmt: PromptFormat) -> Message:
    n = len(fmt.tokenizer.encode(message["content"], add_special_tokens=False))
    return {**message, "content": f"{ELIDED}: {n} tokens]"}
