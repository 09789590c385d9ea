"""Coding task: fix the bug in a small generated Python repository, through a real coding-agent harness.

    agent-r1 train task=coding                    # mini-swe-agent, unchanged, through the gateway
    agent-r1 eval task=coding model=RUN_DIR/policy

Each task is a repository of two files: a module with one function holding one bug (an operator, an off-by-one
range, a comparison, an index, a constant, a method), and a test script that fails on it. The question is the
bug report a user would file. Each episode runs the harness (`task.harness`, mini-swe-agent by default) in a
scratch directory of its own holding the repository; the model's commands run there. When the harness exits,
the reward puts the test script back as the task wrote it (an agent that edits the test gains nothing) and
runs it, sandboxed (`task.sandbox`, bubblewrap by default: the model wrote the code it runs): 1 when it
passes. Tasks are generated from a seed; a task's split is fixed by a hash of its question, as for the other
generated tasks, so the held-out repositories are never trained on.

`demos` are the fixes a person would make (one `sed` and a run of the test, then mini-swe-agent's submit
command): SFT replays them through the harness, so the rows hold the harness's real prompts.
"""

from __future__ import annotations

import random
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.data.splits import Split, split_of
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.gateway.env import Episode, ProgramEnv, ProgramOutput
from agent_r1.tools.sandbox import check_sandbox, run_in_directory
from agent_r1.types import Message

KIND_KEY = "bug"  # eval reports accuracy per kind of bug

# mini-swe-agent as its users run it (`mini`), headless: the task as its argument, every command run without
# confirmation (--yolo), exit when the model submits, no cost limit; its model is the gateway's policy
MINI = (
    sys.executable, "-m", "minisweagent.run.mini", "-m", "openai/agent-r1-policy", "-t", "{question}", "--yolo",
    "--exit-immediately", "-l", "0",
)  # fmt: skip
# no first-run wizard, no cost lookups (litellm's price of an unknown model is an error), litellm's price map local
MINI_ENV = (
    ("MSWEA_CONFIGURED", "true"),
    ("MSWEA_COST_TRACKING", "ignore_errors"),
    ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
)
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # how mini-swe-agent's model ends its task


@dataclass
class Options:
    harness: tuple[str, ...] = MINI
    """the coding agent run per episode, as a command's arguments (`{question}` is the bug report)"""
    harness_env: tuple[tuple[str, str], ...] = MINI_ENV
    """environment variables the harness needs (mini-swe-agent: headless and offline)"""
    sandbox: str = "bwrap"
    """where the reward runs the tests: bwrap (bubblewrap; an error where it cannot run) or none"""
    timeout_s: float = 120.0
    """seconds the harness may take to its next model call or its exit"""
    test_timeout_s: float = 30.0
    """seconds the tests may run before they count as failed"""
    kinds: tuple[str, ...] = ()
    """kinds of bug to generate (operator, range, comparison, index, constant, method); empty = all"""

    def __post_init__(self) -> None:
        check_sandbox(self.sandbox)
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"task.kinds: unknown kind(s) {sorted(unknown)}; use {', '.join(KINDS)}")
        if not self.harness:
            raise ValueError("task.harness is empty")


MODULES = (
    "billing",
    "geometry",
    "inventory",
    "mathutils",
    "metrics",
    "pricing",
    "scoring",
    "stats",
    "textops",
    "units",
)


def _operator(rng: random.Random) -> dict[str, Any]:
    op, name = rng.choice([("+", "total"), ("-", "difference"), ("*", "product")])
    wrong = rng.choice([o for o in ("+", "-", "*") if o != op])
    fn = rng.choice({"+": ["add", "combine", "total_of"], "-": ["subtract", "remaining", "net"],
                     "*": ["multiply", "scaled", "area"]}[op])  # fmt: skip
    args = [(rng.randint(2, 20), rng.randint(2, 20)) for _ in range(2)]
    return {
        "fn": fn, "params": "a, b", "doc": f"Return the {name} of a and b.", "body": f"a {wrong} b", "fix": f"a {op} b",
        "calls": [f"{a}, {b}" for a, b in args], "expected": [eval(f"{a} {op} {b}") for a, b in args],
    }  # fmt: skip


def _range(rng: random.Random) -> dict[str, Any]:
    fn = rng.choice(["sum_to", "triangle", "sum_up_to", "running_total"])
    ns = rng.sample(range(3, 30), 2)
    return {
        "fn": fn, "params": "n", "doc": "Sum of the integers from 1 to n inclusive.", "body": "sum(range(1, n))",
        "fix": "sum(range(1, n + 1))", "calls": [str(n) for n in ns], "expected": [n * (n + 1) // 2 for n in ns],
    }  # fmt: skip


def _comparison(rng: random.Random) -> dict[str, Any]:
    fn = rng.choice(["at_least", "meets_quota", "is_enough", "reaches"])
    limit = rng.randint(5, 50)
    return {
        "fn": fn, "params": "value, limit", "doc": "True when value is at least limit.", "body": "value > limit",
        "fix": "value >= limit", "calls": [f"{limit}, {limit}", f"{limit - 1}, {limit}"], "expected": [True, False],
    }  # fmt: skip


def _index(rng: random.Random) -> dict[str, Any]:
    fn = rng.choice(["last", "newest", "final_item", "most_recent"])
    lists = [rng.sample(range(1, 99), rng.randint(3, 5)) for _ in range(2)]
    return {
        "fn": fn, "params": "items", "doc": "The last item of a non-empty list.", "body": "items[-2]",
        "fix": "items[-1]", "calls": [str(x) for x in lists], "expected": [x[-1] for x in lists],
    }  # fmt: skip


def _constant(rng: random.Random) -> dict[str, Any]:
    fn = rng.choice(["to_fahrenheit", "fahrenheit", "c_to_f", "celsius_to_fahrenheit"])
    wrong = rng.choice([23, 30, 31, 33, 42])
    temps = rng.sample(range(-20, 45, 5), 2)
    return {
        "fn": fn, "params": "celsius", "doc": "Degrees Celsius in Fahrenheit.", "body": f"celsius * 9 / 5 + {wrong}",
        "fix": "celsius * 9 / 5 + 32", "calls": [str(t) for t in temps], "expected": [t * 9 / 5 + 32 for t in temps],
    }  # fmt: skip


def _method(rng: random.Random) -> dict[str, Any]:
    fn = rng.choice(["normalize", "clean_name", "canonical", "tidy"])
    words = [rng.choice(["  Hello ", " World", "MiXeD  ", " Agent R1 ", "Tea "]) for _ in range(2)]
    return {
        "fn": fn, "params": "text", "doc": "The text in lower case, without surrounding spaces.",
        "body": "text.upper().strip()", "fix": "text.lower().strip()", "calls": [repr(w) for w in words],
        "expected": [w.lower().strip() for w in words],
    }  # fmt: skip


KINDS = {
    "operator": _operator, "range": _range, "comparison": _comparison, "index": _index, "constant": _constant,
    "method": _method,
}  # fmt: skip


def make_repo(rng: random.Random, kind: str) -> dict[str, Any]:
    """One task: its repository's files, the bug report, the fix (for demonstrations) and the kind of bug. The
    bug shows on the reported call (a draw where it does not, 2 + 2 against 2 * 2, is drawn again)."""
    while True:
        spec = KINDS[kind](rng)
        fn, call, expected = spec["fn"], spec["calls"][0], spec["expected"][0]
        source = f'def {fn}({spec["params"]}):\n    """{spec["doc"]}"""\n    return {spec["body"]}\n'
        if (got := _call(source, fn, call)) != expected:
            break
    module = rng.choice(MODULES)
    checks = [
        f"    assert {fn}({c}) == {e!r}, {fn}({c})\n" for c, e in zip(spec["calls"], spec["expected"], strict=True)
    ]
    main = f'if __name__ == "__main__":\n    test_{fn}()\n    print("OK")\n'
    test = f"from {module} import {fn}\n\n\ndef test_{fn}():\n{''.join(checks)}\n\n{main}"
    what = spec["doc"][:-1].lower()
    question = (
        f"In {module}.py, {fn}({call}) returns {got!r}, but it should return {expected!r} ({what}). "
        f"Fix {module}.py so that `python3 test_{module}.py` passes; do not edit the test."
    )
    return {
        "question": question, "files": {f"{module}.py": source, f"test_{module}.py": test}, "test": f"test_{module}.py",
        "fix": {"path": f"{module}.py", "old": spec["body"], "new": spec["fix"]}, "bug": kind,
    }  # fmt: skip


def _call(source: str, fn: str, args: str) -> Any:
    """What the buggy function returns (the bug report quotes it)."""
    scope: dict[str, Any] = {}
    exec(source, scope)
    return eval(f"{fn}({args})", scope)


def make_tasks(n: int, seed: int = 0, split: Split = "train", kinds: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """`n` tasks of one split, deterministic in `seed`; the kinds of bug cycle."""
    rng, kinds = random.Random(seed), kinds or tuple(KINDS)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i in range(200 * n + 1000):
        task = make_repo(rng, kinds[i % len(kinds)])
        if split_of(task["question"]) == split and task["question"] not in seen:
            seen.add(task["question"])
            out.append(task)
            if len(out) == n:
                return out
    raise ValueError(f"the generator makes fewer than {n} distinct {split} tasks of kinds {kinds}")


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` tasks of a split."""
    return make_tasks(n, seed=seed, split=split, kinds=options.kinds)


def prepare(task: dict[str, Any], directory: str) -> None:
    """The task's repository, written into the episode's scratch directory before the harness starts."""
    for name, text in task["files"].items():
        (Path(directory) / name).write_text(text)


def passes(task: dict[str, Any], directory: str, isolation: str = "bwrap", timeout_s: float = 30.0) -> bool:
    """Whether the task's test passes over the repository in `directory` as the agent left it, the test script
    put back first (the agent's edits to it do not count); run sandboxed, since the model wrote the code."""
    (Path(directory) / task["test"]).write_text(task["files"][task["test"]])
    # bytecode the agent's own runs cached: an edit of the same size within the same second would leave it
    # looking fresh (Python checks mtime and size), and the test would run the old code
    for cache in Path(directory).rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    # -s -E -B: no user site-packages, no PYTHON* variables, no bytecode written (not -I: the test imports the
    # module beside it)
    argv = [sys.executable, "-s", "-E", "-B", task["test"]]
    code, _ = run_in_directory(argv, Path(directory), isolation, timeout_s)
    return code == 0


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 8) -> ProgramEnv:
    """The harness as an env for one episode: the repository in its scratch directory, the tests as reward."""

    def reward(task: dict[str, Any], episode: Episode, output: ProgramOutput) -> tuple[float, dict[str, float]]:
        solved = float(
            output.workdir is not None and passes(task, output.workdir, options.sandbox, options.test_timeout_s)
        )
        return solved, {"correct": solved}

    return ProgramEnv(
        list(options.harness), prompt_format, reward, timeout_s=options.timeout_s, max_turns=max_turns,
        env=dict(options.harness_env), scratch=True, prepare=prepare,
    )  # fmt: skip


def demos(options: Options, env: ProgramEnv, n: int, seed: int = 0) -> list[list[Message]]:
    """`n` training tasks, each fixed as a person would with mini-swe-agent's bash tool: one `sed` and a run
    of the test, then the submit command (replayed through the harness by SFT)."""
    call = env.format.tool_format.format_call  # the policy's own call syntax
    out = []
    for task in make_tasks(n, seed=seed, kinds=options.kinds):
        fix, module = task["fix"], task["fix"]["path"]
        sed = f"s/{_sed(fix['old'])}/{_sed(fix['new'], replacement=True)}/"
        command = f"sed -i {shlex.quote(sed)} {module} && python3 {task['test']}"
        out.append([
            {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": call("bash", {"command": command})},
            {"role": "user", "content": "OK"},  # (the harness shows the real output when replayed)
            {"role": "assistant", "content": call("bash", {"command": SUBMIT})},
        ])  # fmt: skip
    return out


def _sed(text: str, replacement: bool = False) -> str:
    """`text` escaped for a sed s/// pattern (or replacement)."""
    special = r"[\\/&]" if replacement else r"[\\/.*\[\]^$]"
    return re.sub(special, lambda m: "\\" + m.group(0), text)
