"""The interaction store: every live request as a training step, its rewards with their provenance, and
the weights versions that served, in a real database.

SQLite in WAL mode is the default (one file beside the run: the server writes while the trainer reads);
a PostgreSQL URL (`postgresql+psycopg://...`) lets several servers feed one trainer. Both go through
SQLAlchemy Core, so the schema and every query are written once.

Durability: `record` returns once its transaction has committed, and the server answers the client only
then, so an acknowledged interaction survives a SIGKILL of the server. SQLite's `synchronous=NORMAL`
(the default, `sync="normal"`) commits to the WAL without an fsync: safe against a killed process, not
against a power cut, which can lose the last commits; `sync="full"` fsyncs every commit (and PostgreSQL
always does, unless it is configured not to).

Training state lives beside the data so that nothing is trained twice: the trainer *claims* the
interactions of a step (`trained_step`) before its update, and a trainer resumed from the checkpoint of
step c releases every claim made after c (`release_claims`), whose update was lost with the process.

Token ids, log-probs and versions are packed arrays (int32 / float64 / int32), not JSON: an 8k-token prompt
is 32 KB instead of ~50 KB of text, and unpacks without parsing.
"""

from __future__ import annotations

import array
import hashlib
import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DatabaseError, OperationalError

SCHEMA_VERSION = 1
REWARD_SOURCES = ("explicit", "implicit", "judge")

_meta = sa.MetaData()
META = sa.Table("agent_r1_meta", _meta, sa.Column("key", sa.String(64), primary_key=True), sa.Column("value", sa.Text))
SESSIONS = sa.Table(
    "sessions",
    _meta,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("user", sa.String(256), nullable=False),  # who the per-user cap counts against
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("last_seen", sa.Float, nullable=False),  # a session idle for session_idle_s is settled
)
INTERACTIONS = sa.Table(
    "interactions",
    _meta,
    sa.Column("id", sa.String(128), primary_key=True),  # the response id the client got
    sa.Column("session", sa.String(128), nullable=False, index=True),
    sa.Column("user", sa.String(256), nullable=False),
    sa.Column("request", sa.String(128), nullable=False),  # exploration's n answers share their request
    sa.Column("served", sa.Boolean, nullable=False),  # the answer the client got (the others were explored)
    sa.Column("turn", sa.Integer, nullable=False),  # the request's position in its session
    sa.Column("created", sa.Float, nullable=False, index=True),
    sa.Column("prompt_hash", sa.String(64), nullable=False, index=True),  # GRPO's group key
    sa.Column("prompt_ids", sa.LargeBinary, nullable=False),
    sa.Column("response_ids", sa.LargeBinary, nullable=False),
    sa.Column("logprobs", sa.LargeBinary, nullable=False),
    sa.Column("versions", sa.LargeBinary, nullable=False),  # the weights version that sampled each token
    sa.Column("finish_reason", sa.String(16), nullable=False),
    sa.Column("temperature", sa.Float, nullable=False),  # what the log-probs were taken at
    sa.Column("grammar", sa.Text),
    sa.Column("user_text", sa.Text, nullable=False),  # the request's last user message (redacted)
    sa.Column("asks", sa.Boolean, nullable=False),  # the request ends with a user message (not a tool result)
    sa.Column("answer", sa.Text, nullable=False),  # the answer's text (redacted)
    sa.Column("continues", sa.String(64), nullable=False, index=True),  # digest of the conversation after it
    sa.Column("trainable", sa.Boolean, nullable=False),  # False: redaction changed the answer's words
    sa.Column("trained_step", sa.Integer, index=True),  # the trainer step that claimed it (None: not yet)
    sa.Column("skipped", sa.String(32)),  # why it will never be trained (stale, ...)
)
REWARDS = sa.Table(
    "rewards",
    _meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("interaction", sa.String(128), index=True),  # a reward of one response ...
    sa.Column("session", sa.String(128), index=True),  # ... or of a whole session
    sa.Column("source", sa.String(16), nullable=False),  # explicit | implicit | judge
    sa.Column("score", sa.Float),  # None: the judge failed (the interaction waits, counted)
    sa.Column("detail", sa.Text, nullable=False),  # who or what gave it (JSON)
    sa.Column("created", sa.Float, nullable=False),
)
VERSIONS = sa.Table(
    "versions",
    _meta,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("step", sa.Integer, nullable=False),  # the trainer step whose weights these are
    sa.Column("path", sa.Text),  # a safetensors file every server can read (None: rejected, not kept)
    sa.Column("score", sa.Float),  # the held-out gate's score
    sa.Column("status", sa.String(16), nullable=False),  # serving | rejected | retired
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("note", sa.Text, nullable=False),
)


class StoreError(ValueError):
    """A store that cannot be used: the message is one line naming the file or URL and what is wrong."""


@dataclass
class Interaction:
    """One sampled answer as the store keeps it."""

    id: str
    session: str
    user: str
    request: str
    served: bool
    turn: int
    prompt_ids: list[int]  # [P]
    response_ids: list[int]  # [R]
    logprobs: list[float]  # [R]
    versions: list[int]  # [R]
    finish_reason: str = "stop"
    temperature: float = 1.0
    grammar: str | None = None
    user_text: str = ""
    asks: bool = True
    answer: str = ""
    continues: str = ""
    trainable: bool = True
    created: float = field(default_factory=time.time)
    trained_step: int | None = None

    @property
    def prompt_hash(self) -> str:
        return digest_ids(self.prompt_ids)


@dataclass
class Version:
    version: int
    step: int
    path: str | None
    score: float | None
    status: str
    note: str = ""
    created: float = 0.0


def digest_ids(ids: Sequence[int]) -> str:
    return hashlib.sha256(_pack("i", ids)).hexdigest()[:32]


def _pack(code: str, values: Iterable[Any]) -> bytes:
    return array.array(code, values).tobytes()


def _unpack(code: str, blob: bytes) -> list:
    out = array.array(code)
    out.frombytes(bytes(blob))
    return out.tolist()


def store_url(where: str) -> str:
    """A SQLAlchemy URL from a path (SQLite) or a URL; `postgresql://` uses psycopg 3."""
    if "://" not in where:
        return f"sqlite:///{Path(where).expanduser()}"
    if where.startswith("postgresql://") or where.startswith("postgres://"):
        return "postgresql+psycopg://" + where.split("://", 1)[1]
    return where


class Store:
    """The interaction store at `where` (a SQLite path, or a database URL); created when new, checked when not."""

    def __init__(self, where: str, *, sync: str = "normal", create: bool = True) -> None:
        if sync not in ("normal", "full"):
            raise StoreError(f"store sync must be normal or full, got {sync!r}")
        self.where = where
        url = store_url(where)
        self.sqlite = url.startswith("sqlite")
        if self.sqlite:
            path = Path(url.removeprefix("sqlite:///"))
            if not create and not path.is_file():
                raise StoreError(f"store {where}: no such file")
            path.parent.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {"connect_args": {"timeout": 30}} if self.sqlite else {"pool_pre_ping": True}
        self.engine = sa.create_engine(url, **kwargs)
        if self.sqlite:
            sa.event.listen(self.engine, "connect", lambda conn, _: _sqlite_pragmas(conn, sync))
        try:
            self._open(create)
        except StoreError:
            self.engine.dispose()
            raise
        except OperationalError as exc:
            self.engine.dispose()
            why = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
            if not self.sqlite:  # PostgreSQL that does not answer, or refuses the login
                raise StoreError(f"store {where}: cannot connect ({why})") from None
            raise StoreError(
                f"store {where}: not an agent-r1 interaction store ({why}); expected schema version {SCHEMA_VERSION}"
            ) from None
        except (DatabaseError, sqlite3.DatabaseError) as exc:
            self.engine.dispose()
            why = str(getattr(exc, "orig", exc)).splitlines()[0]
            raise StoreError(
                f"store {where}: not an agent-r1 interaction store ({why}); expected schema version {SCHEMA_VERSION}"
            ) from None

    def _open(self, create: bool) -> None:
        with self.engine.begin() as conn:
            tables = set(sa.inspect(conn).get_table_names())
            if META.name not in tables:
                if tables - {t.name for t in _meta.sorted_tables} or not create:
                    found = ", ".join(sorted(tables)) or "no tables"
                    raise StoreError(
                        f"store {self.where}: not an agent-r1 interaction store (it has {found}); "
                        f"expected schema version {SCHEMA_VERSION}"
                    )
                _meta.create_all(conn)
                conn.execute(sa.insert(META).values(key="schema_version", value=str(SCHEMA_VERSION)))
                return
            found = conn.execute(sa.select(META.c.value).where(META.c.key == "schema_version")).scalar()
            if found != str(SCHEMA_VERSION):
                raise StoreError(
                    f"store {self.where}: schema version {found}, this agent-r1 reads schema version {SCHEMA_VERSION}"
                )

    def close(self) -> None:
        self.engine.dispose()

    # --- the server's side -----------------------------------------------------------------------
    def record(self, interactions: Sequence[Interaction], now: float | None = None) -> None:
        """Commit one request's answers (and its session's last-seen time) in one transaction."""
        if not interactions:
            return
        now = time.time() if now is None else now
        first = interactions[0]
        rows = [
            {
                "id": i.id, "session": i.session, "user": i.user, "request": i.request, "served": i.served,
                "turn": i.turn, "created": i.created, "prompt_hash": i.prompt_hash,
                "prompt_ids": _pack("i", i.prompt_ids), "response_ids": _pack("i", i.response_ids),
                "logprobs": _pack("d", i.logprobs), "versions": _pack("i", i.versions),
                "finish_reason": i.finish_reason, "temperature": i.temperature,
                "grammar": i.grammar, "user_text": i.user_text, "asks": i.asks,
                "answer": i.answer, "continues": i.continues, "trainable": i.trainable,
            }
            for i in interactions
        ]  # fmt: skip
        with self.engine.begin() as conn:
            self._see(conn, first.session, first.user, now)
            conn.execute(sa.insert(INTERACTIONS), rows)

    def touch(self, session: str, user: str, now: float | None = None) -> None:
        """A request of `session` has arrived: it is not settled while the answer is being generated."""
        with self.engine.begin() as conn:
            self._see(conn, session, user, time.time() if now is None else now)

    def _see(self, conn: Any, session: str, user: str, now: float) -> None:
        """Create the session or move its last-seen time, in one statement: two first requests of one session
        at once must not both insert it."""
        insert = (postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert)(SESSIONS)
        row = {"id": session, "user": user, "created": now, "last_seen": now}
        conn.execute(insert.values(**row).on_conflict_do_update(index_elements=["id"], set_={"last_seen": now}))

    def session_of(self, continues: str) -> tuple[str, int] | None:
        """(session, next turn) of the served answer whose conversation `continues` digests, if any."""
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(INTERACTIONS.c.session, INTERACTIONS.c.turn)
                .where(INTERACTIONS.c.continues == continues, INTERACTIONS.c.served)
                .order_by(INTERACTIONS.c.created.desc())
                .limit(1)
            ).first()
        return (row[0], row[1] + 1) if row else None

    def next_turn(self, session: str) -> int:
        with self.engine.connect() as conn:
            n = conn.execute(sa.select(sa.func.max(INTERACTIONS.c.turn)).where(INTERACTIONS.c.session == session))
            last = n.scalar()
        return 0 if last is None else last + 1

    # --- rewards -----------------------------------------------------------------------------------
    def exists(self, *, interaction: str | None = None, session: str | None = None) -> bool:
        table, key = (INTERACTIONS, interaction) if interaction is not None else (SESSIONS, session)
        with self.engine.connect() as conn:
            return conn.execute(sa.select(table.c.id).where(table.c.id == key)).first() is not None

    def add_reward(
        self, source: str, score: float | None, *, interaction: str | None = None, session: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """One reward with its provenance (`source`, `detail`); None as score records a judge's failure."""
        if source not in REWARD_SOURCES:
            raise StoreError(f"reward source must be one of {', '.join(REWARD_SOURCES)}, got {source!r}")
        if (interaction is None) == (session is None):
            raise StoreError("a reward is of one interaction or of one session")
        with self.engine.begin() as conn:
            conn.execute(
                sa.insert(REWARDS).values(
                    interaction=interaction, session=session, source=source, score=score,
                    detail=json.dumps(detail or {}), created=time.time(),
                )
            )  # fmt: skip

    def rewards(self, interactions: Sequence[str], sessions: Sequence[str]) -> list[dict[str, Any]]:
        """Every reward of these interactions and sessions, oldest first."""
        r = REWARDS.c
        query = sa.select(r.interaction, r.session, r.source, r.score, r.detail, r.created).where(
            sa.or_(r.interaction.in_(list(interactions)), r.session.in_(list(sessions)))
        )
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query.order_by(r.id))]

    # --- the trainer's side ------------------------------------------------------------------------
    def untrained(self, limit: int = 10_000) -> list[Interaction]:
        """The newest `limit` interactions neither trained nor skipped, oldest first. The limit keeps the
        trainer's queries under SQLite's 32,766 bound variables; older ones wait (retention ends them)."""
        c = INTERACTIONS.c
        query = (
            sa.select(INTERACTIONS)
            .where(c.trained_step.is_(None), c.skipped.is_(None))
            .order_by(c.created.desc(), c.id.desc())
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [_interaction(row._mapping) for row in conn.execute(query)][::-1]

    def sessions(self, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        query = sa.select(SESSIONS).where(SESSIONS.c.id.in_(list(set(ids))))
        with self.engine.connect() as conn:
            return {row.id: dict(row._mapping) for row in conn.execute(query)}

    def session_interactions(self, sessions: Iterable[str]) -> list[Interaction]:
        """The served interactions of these sessions, in turn order (the implicit signals read them)."""
        c = INTERACTIONS.c
        query = sa.select(INTERACTIONS).where(c.session.in_(list(set(sessions))), c.served).order_by(c.session, c.turn)
        with self.engine.connect() as conn:
            return [_interaction(row._mapping) for row in conn.execute(query)]

    def claim(self, ids: Sequence[str], step: int) -> None:
        """Mark `ids` as trained by `step`, all or none: one of them already claimed (a second trainer on the
        same store) is a StoreError, and nothing is marked."""
        c = INTERACTIONS.c
        with self.engine.begin() as conn:
            n = conn.execute(
                sa.update(INTERACTIONS).where(c.id.in_(list(ids)), c.trained_step.is_(None)).values(trained_step=step)
            ).rowcount
            if n != len(set(ids)):
                raise StoreError(
                    f"store {self.where}: {len(set(ids)) - n} of the step's interactions were already trained "
                    "(is a second trainer reading this store?)"
                )

    def skip(self, ids: Sequence[str], why: str) -> None:
        """Never train `ids` (too stale, ...), and say why."""
        with self.engine.begin() as conn:
            conn.execute(sa.update(INTERACTIONS).where(INTERACTIONS.c.id.in_(list(ids))).values(skipped=why))

    def release_claims(self, after_step: int) -> int:
        """Claims of steps after `after_step` (the checkpoint a trainer resumed from) are undone: their update
        died with the process. Returns how many interactions are untrained again."""
        c = INTERACTIONS.c
        with self.engine.begin() as conn:
            return conn.execute(
                sa.update(INTERACTIONS).where(c.trained_step > after_step).values(trained_step=None)
            ).rowcount

    def counts(self) -> dict[str, int]:
        """Interactions in total, trained, skipped and waiting; rewards by source; judge failures."""
        c, r = INTERACTIONS.c, REWARDS.c
        with self.engine.connect() as conn:
            total = conn.execute(sa.select(sa.func.count()).select_from(INTERACTIONS)).scalar() or 0
            trained = conn.execute(sa.select(sa.func.count()).where(c.trained_step.is_not(None))).scalar() or 0
            skipped = conn.execute(sa.select(sa.func.count()).where(c.skipped.is_not(None))).scalar() or 0
            by_source = conn.execute(
                sa.select(r.source, sa.func.count()).where(r.score.is_not(None)).group_by(r.source)
            ).all()
            failed = conn.execute(sa.select(sa.func.count()).where(r.score.is_(None))).scalar() or 0
        out = {"interactions": total, "trained": trained, "skipped": skipped, "waiting": total - trained - skipped}
        return out | {f"rewards/{s}": n for s, n in by_source} | {"judge_failures": failed}

    def prune(self, older_than_s: float, now: float | None = None) -> int:
        """Retention: interactions (trained, skipped or not) older than `older_than_s` seconds go, with their
        rewards and the sessions left empty. Returns how many interactions went."""
        cutoff = (time.time() if now is None else now) - older_than_s
        c = INTERACTIONS.c
        with self.engine.begin() as conn:
            old = sa.select(c.id).where(c.created < cutoff).scalar_subquery()
            conn.execute(sa.delete(REWARDS).where(REWARDS.c.interaction.in_(old)))
            n = conn.execute(sa.delete(INTERACTIONS).where(c.created < cutoff)).rowcount
            live = sa.select(c.session).distinct().scalar_subquery()
            gone = sa.select(SESSIONS.c.id).where(SESSIONS.c.id.not_in(live)).scalar_subquery()
            conn.execute(sa.delete(REWARDS).where(REWARDS.c.session.in_(gone)))
            conn.execute(sa.delete(SESSIONS).where(SESSIONS.c.id.not_in(live)))
        return n

    # --- versions ----------------------------------------------------------------------------------
    def add_version(self, step: int, path: str | None, score: float | None, status: str, note: str = "") -> int:
        """A new weights version (the next number, from 0); `serving` retires the one serving before it."""
        v = VERSIONS.c
        with self.engine.begin() as conn:
            last = conn.execute(sa.select(sa.func.max(v.version))).scalar()
            number = 0 if last is None else last + 1  # 0: the starting weights, as a fresh server numbers them
            if status == "serving":
                conn.execute(sa.update(VERSIONS).where(v.status == "serving").values(status="retired"))
            conn.execute(
                sa.insert(VERSIONS).values(
                    version=number, step=step, path=path, score=score, status=status, created=time.time(), note=note
                )
            )
        return number

    def forget_weights(self, version: int) -> None:
        """The version's weights file is no longer kept (deleted by the caller): it cannot be rolled back to."""
        with self.engine.begin() as conn:
            conn.execute(sa.update(VERSIONS).where(VERSIONS.c.version == version).values(path=None))

    def serving(self) -> Version | None:
        """The version servers should serve (the last promoted or rolled back to), None before the first."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(VERSIONS).where(VERSIONS.c.status == "serving")).first()
        return _version(row._mapping) if row else None

    def versions(self) -> list[Version]:
        with self.engine.connect() as conn:
            return [_version(r._mapping) for r in conn.execute(sa.select(VERSIONS).order_by(VERSIONS.c.version))]


def _sqlite_pragmas(conn: Any, sync: str) -> None:
    """WAL: the server writes while the trainer reads; a busy wait instead of 'database is locked'."""
    cur = conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA synchronous={sync.upper()}")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def _interaction(m: Any) -> Interaction:
    return Interaction(
        id=m["id"], session=m["session"], user=m["user"], request=m["request"], served=bool(m["served"]),
        turn=m["turn"], prompt_ids=_unpack("i", m["prompt_ids"]), response_ids=_unpack("i", m["response_ids"]),
        logprobs=_unpack("d", m["logprobs"]), versions=_unpack("i", m["versions"]), finish_reason=m["finish_reason"],
        temperature=m["temperature"],
        grammar=m["grammar"], user_text=m["user_text"], asks=bool(m["asks"]), answer=m["answer"],
        continues=m["continues"], trainable=bool(m["trainable"]), created=m["created"], trained_step=m["trained_step"],
    )  # fmt: skip


def _version(m: Any) -> Version:
    return Version(m["version"], m["step"], m["path"], m["score"], m["status"], m["note"], m["created"])
