"""A real, throwaway PostgreSQL server for the tests that need a database: Debian's package (`make postgres`).

One cluster per test session (per pytest-xdist worker), created by initdb in a temporary directory, listening on
127.0.0.1 at a free port and on a Unix socket in that directory: it never meets a cluster the machine already
runs. It is stopped and deleted at the end of the session.

PostgreSQL refuses to run as root, and the tests run as root in containers: there, initdb and the server run as
the `postgres` system user Debian's package creates, in a directory chowned to it. Anyone else runs them directly.

Nothing in the cluster outlives the session, so durability is not worth a disk flush: `initdb --no-sync` and
`fsync=off` (an OS crash would lose the cluster, which is thrown away anyway). Authentication is `trust`: only
processes on this machine can reach the server, and it holds nothing but test tables.

PostgreSQL missing is a failure, not a skip: a database test that does not run tests nothing.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

SUPERUSER = "agent_r1"
TEST_DATABASE = "agent_r1_test"
DEBIAN_BIN_GLOB = "/usr/lib/postgresql/*/bin/initdb"
INSTALL_HINT = "`make postgres` installs it (Debian's postgresql package)"


@dataclass(frozen=True)
class PostgresServer:
    """A running cluster: where to reach it, as its superuser."""

    host: str
    port: int
    user: str = SUPERUSER

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of one of its databases (driver: psycopg 3)."""
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{database}"

    def admin(self) -> psycopg.Connection:
        """An autocommit connection to the `postgres` database (CREATE/DROP DATABASE refuse transactions)."""
        return psycopg.connect(host=self.host, port=self.port, user=self.user, dbname="postgres", autocommit=True)

    def create_database(self, name: str) -> str:
        with self.admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """WITH (FORCE) ends connections a test left open (an engine not disposed) instead of failing."""
        with self.admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _major(initdb: Path) -> int:
    """15 for /usr/lib/postgresql/15/bin/initdb (0 when the directory is not a number)."""
    version = initdb.parent.parent.name
    return int(version) if version.isdigit() else 0


def find_bin_dir() -> Path | None:
    """The directory of initdb and pg_ctl: Debian's newest major version, else an initdb on PATH."""
    debian = sorted((Path(p) for p in glob.glob(DEBIAN_BIN_GLOB)), key=_major)
    if debian:
        return debian[-1].parent
    on_path = shutil.which("initdb")
    # resolved: /usr/local/bin/initdb may be a link into /usr/lib/postgresql/<major>/bin, where pg_ctl is
    return Path(on_path).resolve().parent if on_path else None


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_as_kwargs() -> dict[str, Any]:
    """subprocess arguments that run a PostgreSQL program as a user it accepts: `postgres` when we are root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # the user's PGHOST etc. stay out
    if os.geteuid() != 0:
        return {"env": env}
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail(f"PostgreSQL refuses to run as root and there is no `postgres` user to run it as: {INSTALL_HINT}")
    env.update(HOME=user.pw_dir, USER="postgres", LOGNAME="postgres")
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "env": env}


def make_workdir(run_as: dict[str, Any]) -> Path:
    """A temporary directory the server's user owns (it holds the cluster, the socket and the log)."""
    workdir = Path(tempfile.mkdtemp(prefix="agent-r1-pg-"))
    if "user" in run_as:
        os.chown(workdir, run_as["user"], run_as["group"])
    return workdir


def _run(cmd: list[str], workdir: Path, run_as: dict[str, Any], what: str) -> None:
    result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=120, check=False, **run_as)
    if result.returncode != 0:
        log = workdir / "server.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        pytest.fail(f"PostgreSQL {what} failed ({result.returncode}): {result.stderr.strip()}\n{tail}")


def init_cluster(bin_dir: Path, workdir: Path, run_as: dict[str, Any]) -> Path:
    data = workdir / "data"
    cmd = [str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", SUPERUSER, "--no-sync"]
    _run([*cmd, "-E", "UTF8", "--locale=C"], workdir, run_as, "initdb")
    return data


def start_server(bin_dir: Path, data: Path, workdir: Path, run_as: dict[str, Any]) -> int:
    port = free_port()
    options = f"-k {workdir} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off"
    cmd = [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(workdir / "server.log"), "-w", "-t", "60"]
    _run([*cmd, "-o", options, "start"], workdir, run_as, "start")
    return port


def stop_server(bin_dir: Path, data: Path, workdir: Path, run_as: dict[str, Any]) -> None:
    cmd = [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]
    subprocess.run(cmd, cwd=workdir, capture_output=True, timeout=60, check=False, **run_as)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for this session; fails (never skips) when PostgreSQL is not installed."""
    bin_dir = find_bin_dir()
    if bin_dir is None:
        pytest.fail(f"PostgreSQL is not installed (no {DEBIAN_BIN_GLOB}, no initdb on PATH): {INSTALL_HINT}")
    run_as = run_as_kwargs()
    workdir = make_workdir(run_as)
    data = workdir / "data"
    try:
        init_cluster(bin_dir, workdir, run_as)
        port = start_server(bin_dir, data, workdir, run_as)
        yield PostgresServer(host="127.0.0.1", port=port)
    finally:
        if (data / "postmaster.pid").exists():
            stop_server(bin_dir, data, workdir, run_as)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """SQLAlchemy URL of the session's database, `agent_r1_test` (shared by every test of the session)."""
    return postgres_server.create_database(TEST_DATABASE)


@pytest.fixture
def postgres_db(postgres_server: PostgresServer) -> Iterator[str]:
    """SQLAlchemy URL of a fresh database of this test's own: tests never see each other's tables."""
    name = f"test_{uuid.uuid4().hex[:16]}"
    url = postgres_server.create_database(name)
    yield url
    postgres_server.drop_database(name)
