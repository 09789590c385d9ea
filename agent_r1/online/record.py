"""What `agent-r1 serve --learn` does around each request: find its session, choose whether to explore, and
commit the answers to the interaction store before the client is answered.

A session is, in order: the `X-Session-Id` header; else the request's `user` field with the conversation
it continues; else the conversation alone. A request continues a conversation when its messages up to
the last assistant turn are a served answer's conversation (its request's messages and the answer, as
role, text and tool calls: what an OpenAI client echoes back), so a chat client that resends its history
stays one session without sending anything new.

Exploration (for GRPO's groups, Shao et al. 2024): a share `explore` of plain requests (n = 1, not
streamed) samples `explore_n` answers from the same prompt, serves the first and stores all; the others
are rewarded by a judge only, since nobody saw them.

Redaction runs before anything is stored: `redact(text) -> text` over every message's text and the
answer. A prompt it changed is rendered again from the redacted messages (the answer's ids stay as
sampled; the trainer recomputes their log-probs under the prompt it trains on); an answer it changed
keeps only its redacted text and is never trained (its ids would say what redaction removed).
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent_r1.online.store import Interaction, Store

SESSION_HEADER = "x-session-id"
USER_HEADER = "x-user-id"
INTERACTION_HEADER = "x-agent-r1-interaction"  # the served answer's id, for /v1/feedback


@dataclass
class Place:
    """Where a request belongs: its session, who sent it, its turn in the session."""

    session: str
    user: str
    turn: int


def text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _canonical(message: Mapping[str, Any]) -> list[Any]:
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {}
        try:
            args = json.dumps(json.loads(fn.get("arguments") or "{}"), sort_keys=True)
        except ValueError:
            args = str(fn.get("arguments"))
        calls.append([fn.get("name"), args])
    return [message.get("role"), text_of(message.get("content")).strip(), calls]


def conversation_digest(messages: Sequence[Mapping[str, Any]], user: str = "") -> str:
    """A digest of a conversation as role, text and tool calls (ids and formatting left out)."""
    payload = json.dumps([user, [_canonical(m) for m in messages]], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


class Recorder:
    """Sessions, exploration and redaction in front of a `Store` (module docstring)."""

    def __init__(
        self,
        store: Store,
        *,
        explore: float = 0.0,
        explore_n: int = 4,
        redact: Callable[[str], str] | None = None,
        seed: int = 0,
    ) -> None:
        if not 0 <= explore <= 1:
            raise ValueError(f"explore must be in [0, 1], got {explore}")
        if explore and explore_n < 2:
            raise ValueError(f"explore_n must be >= 2 (the answers of a group), got {explore_n}")
        self.store, self.explore, self.explore_n, self.redact = store, explore, explore_n, redact
        self._rng = random.Random(seed)
        self.recorded = 0

    def explores(self, n: int, stream: bool) -> int:
        """How many answers to sample for a request that asks for `n`: `explore_n` for a share of plain ones."""
        if n == 1 and not stream and self.explore and self._rng.random() < self.explore:
            return self.explore_n
        return n

    def place(self, headers: Mapping[str, str], user: str | None, messages: list[dict[str, Any]]) -> Place:
        """The request's session (module docstring). Runs a query: call it off the event loop."""
        who = (headers.get(USER_HEADER) or user or "")[:256]
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        if session := headers.get(SESSION_HEADER, "")[:128]:
            place = Place(session, who or session, self.store.next_turn(session))
        elif last >= 0 and (found := self.store.session_of(conversation_digest(messages[: last + 1], who))):
            place = Place(found[0], who or found[0], found[1])
        else:
            session = "sess-" + uuid.uuid4().hex
            place = Place(session, who or session, 0)
        self.store.touch(place.session, place.user)  # not settled while this answer is being generated
        return place

    def redacted(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
        """The messages with every text redacted, and whether anything changed."""
        if self.redact is None:
            return messages, False
        out, changed = [], False
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                new = self.redact(content)
            elif isinstance(content, list):
                new = [p | {"text": self.redact(p["text"])} if p.get("type") == "text" else p for p in content]
            else:
                new = content
            changed |= new != content
            out.append(m | {"content": new})
        return out, changed

    def record(
        self, place: Place, request_id: str, ids: Sequence[str], messages: list[dict[str, Any]],
        prompt: list[int], outs: Sequence[Any], answers: Sequence[dict[str, Any]], grammar: str | None = None,
        temperature: float = 1.0, exact: bool = True,
    ) -> None:  # fmt: skip
        """Commit a request's answers (`outs`: GenerateOutput; `answers`: each one's chat message). The first
        continues the session (with n > 1 the client got the first n; the others were explored); every other
        answer is trained as an explored one. `exact`: the log-probs are the full distribution's at
        `temperature` and the ids are the whole prompt (not so under top_p < 1, nor with images, which the store
        does not keep): otherwise stored, never trained. Blocks until committed: call it off the event loop."""
        user_text = next((text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        redact = self.redact or (lambda t: t)
        who = "" if place.user == place.session else place.user  # as `place` digests it
        rows = []
        for k, (out, answer) in enumerate(zip(outs, answers, strict=True)):
            text = text_of(answer.get("content"))
            clean = redact(text)
            shown = answer | {"content": clean}
            rows.append(
                Interaction(
                    id=ids[k], session=place.session, user=place.user, request=request_id, served=k == 0,
                    turn=place.turn, prompt_ids=list(prompt), response_ids=list(out.token_ids),
                    logprobs=list(out.logprobs), versions=list(out.versions or [0] * len(out.token_ids)),
                    finish_reason=out.finish_reason,
                    temperature=temperature, grammar=grammar, user_text=redact(user_text), answer=clean,
                    asks=bool(messages) and messages[-1].get("role") == "user",
                    continues=conversation_digest([*messages, shown], who),
                    trainable=exact and clean == text,
                )
            )  # fmt: skip
        self.store.record(rows)
        self.recorded += len(rows)
