"""The python sandbox under attack: each attack is contained, reported by kind, and the next call works.

Isolation tests (network, filesystem) need bubblewrap; `make test` installs it. Without it they are
skipped with the reason, and the resource-limit tests still run (they hold with isolation="none").
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from agent_r1.tools import sandbox as sandbox_mod
from agent_r1.tools.sandbox import (
    PythonSandbox,
    SandboxLimits,
    bwrap_problem,
    process_limit_problem,
    resolve_isolation,
)

needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no bubblewrap sandbox: {bwrap_problem()}")
ISOLATIONS = [pytest.param("bwrap", marks=needs_bwrap), "none"]
FAST = SandboxLimits(wall_seconds=3, cpu_seconds=1, memory_mb=512)


@pytest.fixture(params=ISOLATIONS)
async def box(request):
    sb = PythonSandbox(FAST, isolation=request.param, persistent=True)
    yield sb
    await sb.aclose()


def sandbox_processes() -> list[psutil.Process]:
    """This test process's sandbox descendants (bwrap, the runner and whatever they started): a contained
    attack leaves none behind once the sandbox closes. Other tests' children (servers) do not count."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
        if "CPULimitExceeded" in command or command.startswith("bwrap"):
            found.append(child)
    return found


async def test_state_persists_and_the_last_expression_is_shown(box):
    assert (await box.run("x = 6\nx * 7")).output == "42\n"
    r = await box.run("print('out'); import sys; print('err', file=sys.stderr); x")
    assert (r.output, r.kind) == ("out\nerr\n6\n", None)  # in the order it was written, then the value


async def test_without_persistence_each_call_is_a_fresh_interpreter_but_files_stay():
    sb = PythonSandbox(FAST, persistent=False)
    try:
        await sb.run("x = 1\nopen('note.txt', 'w').write('kept')")
        r = await sb.run("print(open('note.txt').read())\nx")
        assert r.output.startswith("kept\n") and r.kind == "exception" and "NameError" in r.error
        scratch = sb.scratch
        assert (scratch / "note.txt").read_text() == "kept"
    finally:
        await sb.aclose()
    assert not scratch.exists() and not sandbox_processes()


async def test_an_exception_shows_the_models_traceback_not_the_runners(box):
    r = await box.run("def f():\n    return 1 / 0\nf()")
    assert r.kind == "exception"
    assert 'File "<cell 1>", line 2, in f' in r.error and "return 1 / 0" in r.error
    assert r.error.endswith("ZeroDivisionError: division by zero") and "<string>" not in r.error


async def test_an_infinite_loop_hits_the_cpu_limit_and_the_interpreter_survives(box):
    await box.run("y = 5")
    r = await box.run("while True:\n    pass")
    assert r.kind == "cpu_limit" and "CPU time limit" in r.error and r.seconds < FAST.wall_seconds
    assert (await box.run("y")).output == "5\n"  # same interpreter, variables intact


async def test_a_sleep_past_the_wall_clock_is_killed_and_the_next_call_restarts(box):
    await box.run("z = 1")
    start = time.perf_counter()
    r = await box.run("import time\ntime.sleep(60)")
    assert r.kind == "timeout" and time.perf_counter() - start < FAST.wall_seconds + 2
    r = await box.run("z")
    assert r.kind == "exception" and "NameError" in r.error  # a fresh interpreter


@pytest.mark.skipif(process_limit_problem() is not None, reason=f"no process limit: {process_limit_problem()}")
async def test_a_fork_bomb_is_contained(box):
    r = await box.run("import os\nwhile True:\n    os.fork()")
    assert r.kind == "exception" and "BlockingIOError" in r.error  # the process limit stopped it
    assert (await box.run("1 + 1")).output == "2\n"  # and the interpreter still answers
    await box.aclose()
    deadline = time.time() + 5
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert not sandbox_processes()


async def test_a_10_gb_allocation_is_refused(box):
    r = await box.run("a = bytearray(10 * 1024**3)")
    assert r.kind == "memory_limit" and "MemoryError" in r.error and "512 MB" in r.error
    assert (await box.run("len(bytearray(10 * 1024**2))")).output == "10485760\n"


async def test_a_huge_print_is_cut_and_a_runaway_one_hits_the_output_limit(box):
    r = await box.run("print('x' * 100_000)")
    assert r.kind is None and r.output == "x" * FAST.max_output_chars and r.size == 100_001
    r = await box.run("while True:\n    print('y' * 1000)")
    assert r.kind == "output_limit" and r.size >= FAST.file_mb * 1024 * 1024 - 1000
    assert (await box.run("'alive'")).output == "'alive'\n"


async def test_a_process_that_kills_itself_is_reported_and_replaced(box):
    r = await box.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert r.kind == "killed" and "SIGKILL" in r.error
    assert (await box.run("2 * 21")).output == "42\n"


async def test_the_trainers_environment_does_not_leak_in(box, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key")
    r = await box.run("import os\nsorted(k for k in os.environ if 'KEY' in k or 'TOKEN' in k)")
    assert r.output == "[]\n"


@needs_bwrap
async def test_writing_outside_the_scratch_directory_fails():
    target = Path(tempfile.mkdtemp(dir="/var/tmp"))  # not /tmp: inside the sandbox that is the scratch dir
    target.chmod(0o777)  # writable by anyone: only the sandbox can stop the write
    sb = PythonSandbox(FAST, isolation="bwrap")
    try:
        r = await sb.run(f"open({str(target / 'evil')!r}, 'w').write('x')")
        assert r.kind == "exception" and "Read-only file system" in r.error
        assert (await sb.run("open('/tmp/ok', 'w').write('fine')")).kind is None  # /tmp is the scratch dir
        assert (sb.scratch / "ok").read_text() == "fine"
    finally:
        await sb.aclose()
        written = (target / "evil").exists()
        shutil.rmtree(target)
    assert not written


@needs_bwrap
async def test_the_home_directory_is_hidden():
    secret = Path.home() / f".agent-r1-test-secret-{os.getpid()}"
    secret.write_text("token")
    sb = PythonSandbox(FAST, isolation="bwrap")
    try:
        r = await sb.run(f"open({str(secret)!r}).read()")
        assert r.kind == "exception" and "FileNotFoundError" in r.error
    finally:
        secret.unlink()
        await sb.aclose()


@needs_bwrap
async def test_no_network_not_even_the_hosts_loopback():
    accepted = []
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.settimeout(3)
    thread = threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True)
    thread.start()
    sb = PythonSandbox(FAST, isolation="bwrap")
    try:
        local = await sb.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        remote = await sb.run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)")
    finally:
        await sb.aclose()
    thread.join()
    server.close()
    assert local.kind == "exception" and "ConnectionRefusedError" in local.error
    assert remote.kind == "exception" and "Network is unreachable" in remote.error
    assert accepted == [None]  # the host's server saw no connection


def _accept(server: socket.socket) -> object:
    try:
        return server.accept()
    except TimeoutError:
        return None


def test_limits_and_isolation_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="memory_mb must be positive"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match="isolation must be bwrap or none"):
        resolve_isolation("auto")
    monkeypatch.setattr(sandbox_mod, "bwrap_problem", lambda: "bwrap is not installed")
    with pytest.raises(RuntimeError, match="needs bubblewrap, which does not work here: bwrap is not installed"):
        PythonSandbox()  # the default fails closed: no silent fallback to unisolated model code
    assert resolve_isolation("none") == "none"


def test_a_task_with_the_python_tool_stops_at_start_where_bubblewrap_cannot_run(monkeypatch):
    from agent_r1.tasks.calculator import Options

    monkeypatch.setattr(sandbox_mod, "bwrap_problem", lambda: "bwrap is not installed")
    with pytest.raises(ValueError, match=r"not installed; install it, or choose task\.sandbox=none"):
        Options(tool="python")
    assert Options(tool="python", sandbox="none").sandbox == "none"
    assert Options(tool="calculator").tool == "calculator"  # no sandbox, nothing to check


def test_without_bwrap_the_process_limit_leaves_the_trainers_own_threads_out(monkeypatch):
    """RLIMIT_NPROC counts the user's every thread: a trainer with more threads than `processes` would leave
    the model's code unable to start one. Outside bwrap the limit is the trainer's count plus `processes`."""
    monkeypatch.setattr(sandbox_mod.os, "geteuid", lambda: 1000)
    threads = [threading.Thread(target=time.sleep, args=(2,)) for _ in range(40)]
    for t in threads:
        t.start()
    try:
        limit = sandbox_mod.process_limit(32, "none")
    finally:
        for t in threads:
            t.join()
    assert limit >= 32 + 41  # this process alone holds 41 threads of the user
    assert sandbox_mod.process_limit(32, "bwrap") == 32  # a user namespace of its own counts only the sandbox


def test_a_machine_that_cannot_cap_processes_is_warned_about(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_mod, "process_limit_problem", lambda: "running as root without a pids cgroup")
    sandbox_mod._warn_once.cache_clear()  # said once per process: this test must see it
    with caplog.at_level(logging.WARNING, logger="agent_r1"):
        PythonSandbox(isolation="none")
    assert "without a process limit: running as root without a pids cgroup" in caplog.text


PROBE = """
import asyncio, json, sys
from agent_r1.tools.sandbox import PythonSandbox, SandboxLimits

async def main():
    sb = PythonSandbox(SandboxLimits(wall_seconds=10, cpu_seconds=5, memory_mb=512), isolation=sys.argv[1])
    try:
        where = await sb.run("import sys\\nsys.executable")
        write = await sb.run(f"open({sys.argv[2]!r} + '/evil', 'w').write('x')")
        print(json.dumps([sb.isolation, where.output, write.error]))
    finally:
        await sb.aclose()

asyncio.run(main())
"""


@needs_bwrap
@pytest.mark.parametrize("place", ["tmp", "home", "elsewhere"])
def test_the_sandbox_isolates_wherever_the_interpreter_lives(place, tmp_path):
    """A venv under /tmp (a clone there), under $HOME, or anywhere else: its interpreter starts inside the
    sandbox (the isolation is real, not a silent fallback), sees itself, and cannot write to itself."""
    import subprocess
    import sys
    import sysconfig

    parent = {"tmp": tmp_path, "home": Path.home(), "elsewhere": Path("/var/tmp")}[place]
    root = Path(tempfile.mkdtemp(prefix="agent-r1-venv-", dir=parent))
    try:
        venv = root / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        (site,) = venv.glob("lib/python*/site-packages")
        repo = Path(__file__).resolve().parents[2]
        (site / "agent_r1_test.pth").write_text(f"{repo}\n{sysconfig.get_paths()['purelib']}\n")
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", PROBE, "bwrap", str(venv)],
            capture_output=True, text=True, timeout=120, cwd=root,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        isolation, prefix, write_error = __import__("json").loads(out.stdout.splitlines()[-1])
        assert isolation == "bwrap" and prefix.strip().strip("'") == str(venv / "bin" / "python")
        assert "Read-only file system" in write_error and not (venv / "evil").exists()
    finally:
        shutil.rmtree(root)
