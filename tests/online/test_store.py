"""The interaction store, on SQLite and on a real PostgreSQL server: what is committed comes back exactly,
claims are all-or-none and released after a resume, a file that is not a store is refused in one line."""

from __future__ import annotations

import sqlite3
import time

import pytest

from agent_r1.online.store import SCHEMA_VERSION, Interaction, Store, StoreError


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    where = str(tmp_path / "store.db") if request.param == "sqlite" else request.getfixturevalue("postgres_db")
    s = Store(where)
    yield s
    s.close()


def answer(k: int, session: str = "s1", turn: int = 0, **kw) -> Interaction:
    base = dict(
        id=f"a{k}", session=session, user="u1", request=f"r{k}", served=True, turn=turn,
        prompt_ids=[1, 2, 3, 1000 + k], response_ids=[7, 8, -1 + 2**31 - 1], logprobs=[-0.1234567890123, -2.5, 0.0],
        versions=[3, 3, 4], user_text=f"question {k}", answer=f"answer {k}", continues=f"c{k}",
    )  # fmt: skip
    return Interaction(**(base | kw))


def test_an_interaction_comes_back_exactly_as_recorded(store):
    a = answer(1, grammar="root ::= x", finish_reason="length", asks=False)
    store.record([a])
    (back,) = store.untrained()
    assert back.prompt_ids == a.prompt_ids and back.response_ids == a.response_ids
    assert back.logprobs == a.logprobs  # float64: the engine's log-probs to the last bit
    assert back.versions == [3, 3, 4] and back.grammar == "root ::= x" and back.finish_reason == "length"
    assert (back.session, back.user, back.turn, back.served, back.asks) == ("s1", "u1", 0, True, False)
    assert back.prompt_hash == a.prompt_hash


def test_sessions_are_found_by_the_conversation_they_continue(store):
    store.record([answer(1)])
    store.record([answer(2, turn=1)])
    assert store.session_of("c2") == ("s1", 2)
    assert store.session_of("nothing") is None
    assert store.next_turn("s1") == 2 and store.next_turn("s9") == 0


def test_claims_are_all_or_none_and_a_resume_releases_the_lost_steps(store):
    store.record([answer(k) for k in range(4)])
    store.claim(["a0", "a1"], step=1)
    with pytest.raises(StoreError, match="already trained"):
        store.claim(["a1", "a2"], step=2)  # a1 is step 1's: nothing of this claim is marked
    assert {i.id for i in store.untrained()} == {"a2", "a3"}
    store.claim(["a2"], step=2)
    store.claim(["a3"], step=3)
    assert store.release_claims(after_step=1) == 2  # resumed from step 1's checkpoint: steps 2 and 3 were lost
    assert {i.id for i in store.untrained()} == {"a2", "a3"}
    assert store.counts()["trained"] == 2


def test_rewards_keep_their_provenance(store):
    store.record([answer(1)])
    store.add_reward("explicit", 0.75, interaction="a1", detail={"comment": "good"})
    store.add_reward("judge", None, interaction="a1", detail={"error": "timeout"})
    store.add_reward("explicit", 1.0, session="s1")
    got = store.rewards(["a1"], ["s1"])
    assert [(r["source"], r["score"]) for r in got] == [("explicit", 0.75), ("judge", None), ("explicit", 1.0)]
    counts = store.counts()
    assert counts["rewards/explicit"] == 2 and counts["judge_failures"] == 1
    with pytest.raises(StoreError, match="one interaction or of one session"):
        store.add_reward("explicit", 1.0)
    with pytest.raises(StoreError, match="reward source"):
        store.add_reward("vibes", 1.0, session="s1")


def test_retention_deletes_old_interactions_with_their_rewards_and_empty_sessions(store):
    now = time.time()
    store.record([answer(1, created=now - 100)])
    store.record([answer(2, session="s2", created=now)])
    store.add_reward("explicit", 1.0, interaction="a1")
    store.add_reward("explicit", 1.0, session="s1")
    assert store.prune(older_than_s=50, now=now) == 1
    assert [i.id for i in store.untrained()] == ["a2"]
    assert store.rewards(["a1"], ["s1"]) == []
    assert store.exists(session="s2") and not store.exists(session="s1")


def test_versions_have_one_serving_at_a_time(store):
    assert store.serving() is None
    one = store.add_version(0, "/w/1.safetensors", 0.5, "serving")
    two = store.add_version(1, None, 0.4, "rejected")
    three = store.add_version(2, "/w/3.safetensors", 0.6, "serving")
    assert (one, two, three) == (0, 1, 2)
    assert store.serving().version == 2
    assert [v.status for v in store.versions()] == ["retired", "rejected", "serving"]


def test_a_file_that_is_not_a_store_is_refused_in_one_line(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError) as err:
        Store(str(junk))
    assert str(junk) in str(err.value) and f"schema version {SCHEMA_VERSION}" in str(err.value)
    assert "\n" not in str(err.value)

    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
    with pytest.raises(StoreError, match=r"not an agent-r1 interaction store \(it has invoices\)"):
        Store(str(foreign))


def test_a_store_of_another_schema_version_names_both(tmp_path):
    path = str(tmp_path / "old.db")
    Store(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE agent_r1_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match=f"schema version 99, this agent-r1 reads schema version {SCHEMA_VERSION}"):
        Store(path)


def test_sqlite_runs_in_wal_mode(tmp_path):
    path = tmp_path / "wal.db"
    Store(str(path)).close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
