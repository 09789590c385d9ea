"""Servers this process starts as its children: an OpenEnv app, a user simulator's `agent-r1 serve`.

A child process, not a thread: the server's work does not hold this process's GIL, and one that
crashes takes only itself down (the next caller starts it again). Each is keyed by what it serves,
started once per process on first use, and stopped when the process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

_SERVERS: dict[str, tuple[subprocess.Popen, str]] = {}  # key -> (its server process, its URL)
_LOCK = threading.Lock()


def local_server(key: str, command: Callable[[int], list[str]], what: str, startup_s: float = 60.0) -> str:
    """The URL of the server `key` names, started as `command(port)` on a free port of 127.0.0.1 when
    none is running, and ready once it answers GET /health. `what` names it in errors: one that exits
    at start is a one-line error with the last line it printed."""
    import httpx

    with _LOCK:
        running = _SERVERS.get(key)
        if running is not None and running[0].poll() is None:
            return running[1]
        for attempt in range(3):  # the free port may be taken before the server binds it: try another
            port = _free_port()
            with tempfile.TemporaryFile() as log:  # what it prints, for the error if it cannot start
                io = {"stdin": subprocess.DEVNULL, "stdout": log, "stderr": subprocess.STDOUT}
                proc = subprocess.Popen(command(port), **io, start_new_session=True)
                atexit.register(_stop, proc)
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + startup_s
                while proc.poll() is None:
                    with contextlib.suppress(httpx.HTTPError):
                        if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                            _SERVERS[key] = (proc, url)
                            return url
                    if time.monotonic() > deadline:
                        _stop(proc)
                        raise RuntimeError(f"{what} did not answer {url}/health within {startup_s:g}s")
                    time.sleep(0.1)
                log.seek(0)
                lines = log.read().decode(errors="replace").strip().splitlines()
            last = lines[-1].strip() if lines else f"exit code {proc.returncode}"
            if "address already in use" not in last.lower() or attempt == 2:
                raise RuntimeError(f"{what} exited at start: {last}")
    raise AssertionError("unreachable")


def stop_local_servers() -> None:
    """Stop every server `local_server` started in this process (also done at exit)."""
    with _LOCK:
        for proc, _ in _SERVERS.values():
            _stop(proc)
        _SERVERS.clear()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
