"""A Python interpreter in a separate, limited process: what the `python` tool runs model code in.

Model code is untrusted by construction: during RL the policy writes infinite loops, fork bombs,
10 GB allocations and megabyte prints as a matter of course. Each `PythonSandbox` owns one
interpreter process (`_sandbox_runner.py`) and a scratch directory for one trajectory. What is
enforced, and how (docs/reliability.md has the full table):

- **Resource limits** (always, set by the interpreter on itself before any model code runs): CPU
  seconds per call (RLIMIT_CPU, moved before each call), address space (RLIMIT_AS), file size, the
  printed output included (RLIMIT_FSIZE), processes (RLIMIT_NPROC), open files, no core dumps. A
  wall-clock deadline per call kills the whole process tree past it.
- **Isolation with bubblewrap** (`isolation="bwrap"`, the default; where it cannot run, the sandbox
  refuses to start rather than run model code unisolated, unless `isolation="none"` is chosen): new
  user, PID, network, IPC and UTS namespaces; the host filesystem read-only and this user's home
  hidden (the Python installation, wherever it lives, mounted back read-only); the scratch directory
  the only writable place (mounted at /tmp, also the working directory); a fresh /proc and a minimal
  /dev; all capabilities dropped; the tree dies with its parent. No network at all (only a private
  loopback). The way Flatpak sandboxes applications. Under root, a pids cgroup caps the processes
  (the kernel exempts root from RLIMIT_NPROC).
- **Not enforced**: a system-call filter (no seccomp profile: the kernel surface is that of an
  unprivileged user namespace); the total size of the scratch directory (each file is limited, their
  sum is not); with `isolation="none"`, chosen explicitly, there is no network or filesystem isolation
  at all, only the limits above.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import psutil

log = logging.getLogger(__name__)

Isolation = Literal["bwrap", "none"]
NOBODY = 65534  # the uid and gid the code sees inside the sandbox
RUNNER = (Path(__file__).with_name("_sandbox_runner.py")).read_text()
_REPLY_LIMIT = 16 * 1024 * 1024  # one reply line (JSON of a capped output) is far below this
# The interpreter starts with -S (no site: its .pth files, an editable install's finder above all, cost
# half of a 100 ms start) and gets this environment's package directories instead: numpy, sympy and
# whatever else is installed import as usual.
_PATHS = site.getsitepackages()


@dataclass(frozen=True)
class SandboxLimits:
    """What one interpreter may use. Per call unless said otherwise."""

    wall_seconds: float = 10.0
    """wall-clock time per call; past it the interpreter and its children are killed"""
    cpu_seconds: int = 5
    """CPU time per call (RLIMIT_CPU); past it the call fails with a CPU-limit error"""
    session_cpu_seconds: int = 120
    """CPU time of one interpreter over all its calls (the hard RLIMIT_CPU)"""
    memory_mb: int = 1024
    """address space of the interpreter and of each process it starts (RLIMIT_AS)"""
    file_mb: int = 16
    """largest file the code may write, its printed output included (RLIMIT_FSIZE)"""
    processes: int = 32
    """processes and threads (RLIMIT_NPROC; counted per sandbox under bwrap, per user without it)"""
    open_files: int = 64
    """open file descriptors per process (RLIMIT_NOFILE)"""
    max_output_chars: int = 4000
    """printed output kept per call; the rest is cut, and the model is told how much there was"""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {value}")
        if self.open_files < 16:
            raise ValueError(f"sandbox limit open_files must be >= 16 (Python needs some), got {self.open_files}")


@dataclass
class CellResult:
    """One call's outcome: the text the model sees, and the failure kind the trainer counts."""

    output: str  # printed output (stdout and stderr interleaved), cut to max_output_chars
    size: int  # bytes printed in all
    kind: str | None  # None, exception, timeout, cpu_limit, memory_limit, output_limit or killed
    error: str | None  # traceback or the limit that stopped the code
    seconds: float


class PythonSandbox:
    """One trajectory's interpreter and scratch directory. `run` never raises for what the code does.

    With `persistent=True` the interpreter (and its variables) lives across the calls of the
    trajectory, like a notebook kernel; otherwise each call gets a fresh interpreter. Files in the
    scratch directory last for the whole trajectory either way. `aclose` ends both.
    """

    def __init__(
        self, limits: SandboxLimits | None = None, *, isolation: Isolation = "bwrap", persistent: bool = False
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.isolation = resolve_isolation(isolation)
        if (problem := process_limit_problem()) is not None:
            _warn_once(f"python sandbox without a process limit: {problem}; a fork bomb is not contained")
        self.persistent = persistent
        self.scratch: Path | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._cgroup: PidsCgroup | None = None
        self._calls_in_process = 0  # calls the current interpreter has served (its state, when persistent)

    async def run(self, code: str) -> CellResult:
        """Run `code` in the interpreter; a dead or timed-out interpreter is replaced on the next call."""
        start = time.perf_counter()
        if self._proc is None:
            await self._start()
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write((json.dumps({"code": code}) + "\n").encode())
            await self._proc.stdin.drain()
            line = await asyncio.wait_for(self._proc.stdout.readline(), self.limits.wall_seconds)
        except TimeoutError:
            await self._kill()
            message = f"timed out: the code ran past the {self.limits.wall_seconds:g} s limit and was stopped"
            return CellResult("", 0, "timeout", message, time.perf_counter() - start)
        except (OSError, ValueError):  # died before reading (ValueError: line over the limit)
            line = b""
        except BaseException:  # cancelled by the caller's deadline: never leave a process behind
            await self._kill()
            raise
        self._calls_in_process += 1
        reply = _parse_reply(line)
        if reply is None:
            return CellResult("", 0, "killed", await self._death_message(), time.perf_counter() - start)
        if not self.persistent:
            await self._kill()
        output = reply["output"][: self.limits.max_output_chars]
        return CellResult(output, reply["size"], reply["kind"], reply["error"], time.perf_counter() - start)

    @property
    def had_state(self) -> bool:
        """Whether a persistent interpreter had served calls, i.e. whether a restart loses variables."""
        return self.persistent and self._calls_in_process > 0

    async def aclose(self) -> None:
        """Kill the interpreter and delete the scratch directory (end of the trajectory)."""
        await self._kill()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    async def _start(self) -> None:
        if self.scratch is None:
            self.scratch = Path(tempfile.mkdtemp(prefix="agent-r1-python-"))
        config = {**asdict(self.limits), "max_output_bytes": 4 * self.limits.max_output_chars, "paths": _PATHS}
        config["processes"] = process_limit(self.limits.processes, self.isolation)
        command = [sys.executable, "-I", "-S", "-c", RUNNER, json.dumps(config)]
        self._cgroup = PidsCgroup.create(self.limits.processes)
        self._proc = await asyncio.create_subprocess_exec(
            *(_bwrap_prefix(self.scratch) + command if self.isolation == "bwrap" else command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self.scratch,
            env=_clean_env(self.scratch if self.isolation == "none" else Path("/tmp")),
            start_new_session=True,  # one process group to kill, whatever the code starts
            limit=_REPLY_LIMIT,
            preexec_fn=self._cgroup.join if self._cgroup else None,
        )
        self._calls_in_process = 0

    async def _kill(self) -> None:
        """SIGKILL the interpreter's process group (and so, under bwrap, its whole PID namespace)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # The group holds the process itself (its own session). No `proc.kill()` after this: Popen polls
        # before it signals, and that poll would reap the child under asyncio's watcher, which then logs
        # "Unknown child process" and reports exit code 255.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if self._cgroup is not None:
            await self._cgroup.remove()
            self._cgroup = None

    async def _death_message(self) -> str:
        """Why the interpreter ended without answering: a signal (a hard limit) or its own error output."""
        proc = self._proc
        assert proc is not None
        with contextlib.suppress(TimeoutError):  # let it finish exiting: its own exit code, not our SIGKILL
            await asyncio.wait_for(proc.wait(), 2)
        await self._kill()
        stderr = (await proc.stderr.read(2000)).decode(errors="replace").strip() if proc.stderr else ""
        code = proc.returncode
        # a signal ends the process directly (-N), or bwrap's inner process, which bwrap reports as 128 + N
        signum = -code if code is not None and code < 0 else None
        if code is not None and code > 128 and self.isolation == "bwrap":
            signum = code - 128
        if signum is not None:
            name = signal.Signals(signum).name
            why = {"SIGKILL": "killed (by the code itself, or a hard limit)", "SIGXCPU": "the CPU time limit"}
            return f"the interpreter was stopped by {name}: {why.get(name, 'a signal')}"
        return f"the interpreter exited with code {code}" + (f": {stderr.splitlines()[-1]}" if stderr else "")


def _parse_reply(line: bytes) -> dict | None:
    """The runner's reply, or None when the process died (or wrote something that is not a reply)."""
    try:
        reply = json.loads(line)
    except ValueError:
        return None
    keys = {"output", "size", "kind", "error"}
    return reply if isinstance(reply, dict) and keys <= reply.keys() else None


def run_in_directory(
    argv: list[str], directory: Path, isolation: Isolation = "bwrap", timeout_s: float = 30.0
) -> tuple[int | None, str]:
    """(exit code, the output's tail) of a command over files model-written code touched (a coding task's
    tests), run in `directory` with a clean environment and, under bwrap, as the python tool's code runs:
    the directory writable at /tmp, the rest of the host read-only, no network, this user's home hidden.
    The exit code is None when it ran past `timeout_s` (killed)."""
    isolation = resolve_isolation(isolation)
    command = _bwrap_prefix(directory) + argv if isolation == "bwrap" else argv
    cwd = "/" if isolation == "bwrap" else str(directory)
    try:
        done = subprocess.run(
            command, cwd=cwd, env=_clean_env(Path("/tmp") if isolation == "bwrap" else directory),
            capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:g}s"
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")[-2000:]


def _clean_env(home: Path) -> dict[str, str]:
    """A minimal environment: nothing of the trainer's (tokens, keys) leaks into model code."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",  # the same code prints the same set order in every run
        # one thread per numeric library: thread pools reserve address space (RLIMIT_AS) and processes
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _bwrap_prefix(scratch: Path) -> list[str]:
    """bubblewrap's command line: the host read-only, the scratch directory writable at /tmp, no network,
    and this user's home hidden (tokens, keys). The Python installation is mounted back, read-only, on
    top of whatever hides it: a venv under $HOME or under /tmp (a clone in /tmp is common) must stay
    visible, or the interpreter cannot start and the sandbox would refuse to start."""
    home = os.path.realpath(Path.home())
    return [
        "bwrap",
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", home,
        "--bind", str(scratch), "/tmp",
        *(arg for p in _hidden_python_paths(home) for arg in ("--ro-bind", p, p)),
        "--chdir", "/tmp",
        "--unshare-all", "--unshare-user",  # user, PID, network, IPC, UTS and cgroup namespaces
        "--uid", str(NOBODY), "--gid", str(NOBODY),
        "--die-with-parent",
        "--new-session",  # no TIOCSTI into the terminal that started the trainer
        "--cap-drop", "ALL",
    ]  # fmt: skip


def _hidden_python_paths(home: str) -> list[str]:
    """The interpreter's prefixes and package directories that the home tmpfs or the /tmp bind would hide,
    outermost first (a nested one is already inside its parent's mount). Both the path as Python names it
    and its real path: a symlinked venv is reached through the link, its files through the target."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable), *_PATHS}
    paths = {q for p in candidates for q in (os.path.abspath(p), os.path.realpath(p)) if os.path.isdir(q)}
    hidden = sorted(p for p in paths if any(p == d or p.startswith(d + os.sep) for d in (home, "/tmp")))
    return [p for i, p in enumerate(hidden) if not any(p.startswith(q + os.sep) for q in hidden[:i])]


class PidsCgroup:
    """A cgroup (v1 pids controller) that caps the processes of one sandbox, for when we run as root.

    RLIMIT_NPROC does not bind root (the kernel exempts uid 0, even inside a user namespace), so a
    root trainer bounds a fork bomb with `pids.max`, as container runtimes do. Without a writable
    pids hierarchy (not root, or cgroup v2 only) this is None and RLIMIT_NPROC does the job, since an
    unprivileged sandbox counts its processes in its own user namespace.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, limit: int) -> PidsCgroup | None:
        root = Path("/sys/fs/cgroup/pids")
        if os.geteuid() != 0 or not (root / "cgroup.procs").exists():
            return None
        own = next((line.split(":", 2)[2].strip() for line in _read("/proc/self/cgroup") if ":pids:" in line), "/")
        path = root / own.lstrip("/") / f"agent-r1-python-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(limit))
        except OSError:
            return None
        return cls(path)

    def join(self) -> None:
        """Move the calling process into the cgroup (run in the child before exec: its tree follows)."""
        (self.path / "cgroup.procs").write_text("0")

    async def remove(self) -> None:
        """rmdir once the killed processes are gone (they exit asynchronously after SIGKILL)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                await asyncio.sleep(0.02)


@functools.cache
def process_limit_problem() -> str | None:
    """None when a sandbox's processes are capped here, else why not (then a fork bomb is not contained)."""
    if os.geteuid() != 0:
        return None  # RLIMIT_NPROC binds
    probe = PidsCgroup.create(1)
    if probe is None:
        return "running as root (exempt from RLIMIT_NPROC) without a writable cgroup-v1 pids hierarchy"
    probe.path.rmdir()
    return None


def _read(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def resolve_isolation(isolation: Isolation) -> Literal["bwrap", "none"]:
    """`bwrap`, when it works here; else an error that names the remedy. Model code never runs unisolated
    because a machine happens to lack bubblewrap (a warning on a Ray worker goes unseen): only an explicit
    `none` runs it with resource limits alone."""
    if isolation not in ("bwrap", "none"):
        raise ValueError(f"sandbox isolation must be bwrap or none, got {isolation!r}")
    if isolation == "bwrap" and (problem := bwrap_problem()) is not None:
        raise RuntimeError(
            f"the python sandbox needs bubblewrap, which does not work here: {problem}; install it, or choose "
            "isolation none (task.sandbox=none) to run model code with resource limits only"
        )
    return isolation


def check_sandbox(isolation: str) -> None:
    """A task's `sandbox` option, checked when the config is read: a machine without bubblewrap stops the
    run at start, in one line, not in every episode after it began."""
    try:
        resolve_isolation(isolation)  # type: ignore[arg-type]
    except RuntimeError as exc:
        raise ValueError(str(exc).replace("isolation none (task.sandbox=none)", "task.sandbox=none")) from None


def process_limit(processes: int, isolation: str) -> int:
    """RLIMIT_NPROC for the interpreter. It counts every process and thread of the user in the user
    namespace: under bwrap that is the sandbox's own namespace, but with `isolation="none"` it holds the
    trainer's threads too (torch's, tokenizers', Ray's), so the model's code would get only what is left of
    `processes`, or nothing at all. There the trainer's current count is added. Root is exempt (pids cgroup)."""
    if isolation == "bwrap" or os.geteuid() == 0:
        return processes
    uid = os.getuid()
    own = 0
    for proc in psutil.process_iter(["uids", "num_threads"]):
        if proc.info["uids"] is not None and proc.info["uids"].real == uid:
            own += proc.info["num_threads"] or 1
    return processes + own


@functools.cache
def bwrap_problem() -> str | None:
    """None when a bubblewrap sandbox starts here, else why not (checked once per process)."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory() as scratch:
        try:
            probe = subprocess.run(
                [*_bwrap_prefix(Path(scratch)), sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap did not start: {exc}"
    if probe.returncode != 0:
        lines = probe.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1] if lines else f"exit code {probe.returncode}"
        return f"bwrap failed ({why}); unprivileged user namespaces may be disabled"
    return None


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
