"""The PostgreSQL fixtures start a real server: a table written through SQLAlchemy reads back, and each test's
database is its own."""

from __future__ import annotations

import sqlalchemy as sa


def test_a_row_written_reads_back(postgres_db: str) -> None:
    engine = sa.create_engine(postgres_db)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE notes (id serial PRIMARY KEY, body text NOT NULL)"))
            conn.execute(sa.text("INSERT INTO notes (body) VALUES (:body)"), {"body": "hello, postgres"})
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT body FROM notes")).scalars().all() == ["hello, postgres"]
            assert conn.execute(sa.text("SHOW server_version")).scalar_one().split(".")[0].isdigit()
            assert conn.execute(sa.text("SHOW fsync")).scalar_one() == "off"
    finally:
        engine.dispose()


def test_each_test_gets_its_own_database(postgres_db: str, postgres_url: str) -> None:
    """The table of the test above is not here, and the session database is another one."""
    engine = sa.create_engine(postgres_db)
    try:
        with engine.connect() as conn:
            assert not sa.inspect(conn).has_table("notes")
            assert conn.execute(sa.text("SELECT current_database()")).scalar_one().startswith("test_")
    finally:
        engine.dispose()
    assert postgres_url.endswith("/agent_r1_test")
    session = sa.create_engine(postgres_url)
    try:
        with session.connect() as conn:
            assert conn.execute(sa.text("SELECT current_database()")).scalar_one() == "agent_r1_test"
    finally:
        session.dispose()
