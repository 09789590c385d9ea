"""The `python` tool in an episode: every attack becomes an observation and a counted error kind,
the episode goes on to its answer, and the sandbox is gone when the episode ends."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.tools import execute_tool_call, python_tool
from agent_r1.tools import sandbox as sandbox_mod
from agent_r1.tools.python import observation
from agent_r1.tools.sandbox import CellResult, SandboxLimits, bwrap_problem, process_limit_problem
from agent_r1.types import Termination
from tests.rollout.test_agent_loop import ScriptedEngine
from tests.tools.test_sandbox import sandbox_processes

LIMITS = SandboxLimits(wall_seconds=3, cpu_seconds=1, memory_mb=512)
ISOLATION = "bwrap" if bwrap_problem() is None else "none"  # the limits hold either way
ATTACKS = [  # (code, the error kind it must be counted as, what the model must read)
    ("while True:\n    pass", "cpu_limit", "CPU time limit"),
    ("import time\ntime.sleep(30)", "timeout", "3 s limit"),
    ("x = bytearray(10 * 1024**3)", "memory_limit", "MemoryError"),
    ("while True:\n    print('z' * 4096)", "output_limit", "bytes printed in all"),
]
if process_limit_problem() is None:  # where processes cannot be capped, no fork bomb is run
    ATTACKS.append(("import os\nwhile True:\n    os.fork()", "exception", "BlockingIOError"))
if bwrap_problem() is None:  # isolation: the attempt fails inside the code, an `exception` the model reads
    ATTACKS.append(("open('/var/tmp/agent-r1-escape', 'w')", "exception", "Read-only file system"))
    ATTACKS.append(("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)", "exception", "unreachable"))


def call(code: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call>"


def test_an_episode_survives_every_attack_and_counts_each(tokenizer):
    tools = []

    def make_env():
        tools.append(python_tool(LIMITS, isolation=ISOLATION))
        return ToolEnv(
            {"python": tools[-1]}, ChatFormat(tokenizer), lambda task, text: float("42" in text), max_turns=10
        )

    script = [call(code) for code, _, _ in ATTACKS] + [call("print(6 * 7)"), "<answer>42</answer>"]
    loop = AgentEnvLoop(ScriptedEngine(tokenizer, script), make_env, SamplingParams())
    (traj,) = loop.run_sync([{"question": "what is 6 * 7?"}])

    assert traj.termination == Termination.ANSWERED and traj.reward == 1.0 and traj.error is None
    results = [s.info["tool_results"][0] for s in traj.steps[:-1]]
    assert [r["error"] for r in results] == [kind for _, kind, _ in ATTACKS] + [None]
    for (code, _, shown), result in zip(ATTACKS, results[:-1], strict=True):
        assert shown in result["output"], (code, result["output"])
    assert results[-1]["output"] == "42"
    for kind, n in Counter(kind for _, kind, _ in ATTACKS).items():
        assert traj.metrics[f"tool_errors/{kind}"] == n
    assert traj.metrics["tool_errors"] == len(ATTACKS)
    assert not Path("/var/tmp/agent-r1-escape").exists()
    assert not sandbox_processes()  # the env was closed: no interpreter left


async def test_bad_arguments_are_the_usual_invalid_arguments_error():
    tool = python_tool(LIMITS, isolation=ISOLATION)
    r = await execute_tool_call({"python": tool}, "python", {"source": "1"})
    assert r.error == "invalid_arguments" and "code" in r.output
    r = await execute_tool_call({"python": tool}, "python", '{"code": "print(1 + 1)"}')
    assert (r.output, r.error) == ("2", None)
    await tool.close()


def test_observations_say_what_was_cut_and_what_was_lost():
    cut = observation(CellResult("abc", 10_000, None, None, 0.1))
    assert cut == "abc\n...[output cut: 10000 bytes printed in all]"
    assert observation(CellResult("", 0, None, None, 0.1)).startswith("(no output")
    lost = observation(CellResult("", 0, "timeout", "timed out", 2.0), restarted=True)
    assert lost.startswith("Error: timed out") and "variables from earlier calls are gone" in lost


def test_the_tools_description_does_not_change_with_the_machines_isolation(monkeypatch):
    """A policy trained where bubblewrap runs must see the same prompt where it does not."""
    bare = python_tool(LIMITS, isolation="none").description
    monkeypatch.setattr(sandbox_mod, "bwrap_problem", lambda: None)
    assert python_tool(LIMITS, isolation="bwrap").description == bare
