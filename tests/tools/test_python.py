"""The `python` tool in an episode: every attack becomes an observation and a counted error kind,
the episode goes on to its answer, and the sandbox is gone when the episode ends."""

from __future__ import annotations

import json

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.engine import SamplingParams
from agent_r1.tools import execute_tool_call, python_tool
from agent_r1.tools.python import observation
from agent_r1.tools.sandbox import CellResult, SandboxLimits, process_limit_problem
from agent_r1.types import Termination
from tests.rollout.test_agent_loop import ScriptedEngine
from tests.tools.test_sandbox import sandbox_processes

LIMITS = SandboxLimits(wall_seconds=3, cpu_seconds=1, memory_mb=512)
ATTACKS = {  # code -> the error kind it must be counted as
    "while True:\n    pass": "cpu_limit",
    "import time\ntime.sleep(30)": "timeout",
    "import os\nwhile True:\n    os.fork()": "exception",  # dropped below where processes are not capped
    "x = bytearray(10 * 1024**3)": "memory_limit",
    "while True:\n    print('z' * 4096)": "output_limit",
}
if process_limit_problem() is not None:
    del ATTACKS["import os\nwhile True:\n    os.fork()"]


def call(code: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call>"


def test_an_episode_survives_every_attack_and_counts_each(tokenizer):
    tools = []

    def make_env():
        tools.append(python_tool(LIMITS))
        return ToolEnv(
            {"python": tools[-1]}, ChatFormat(tokenizer), lambda task, text: float("42" in text), max_turns=8
        )

    script = [call(code) for code in ATTACKS] + [call("print(6 * 7)"), "<answer>42</answer>"]
    loop = AgentEnvLoop(ScriptedEngine(tokenizer, script), make_env, SamplingParams())
    (traj,) = loop.run_sync([{"question": "what is 6 * 7?"}])

    assert traj.termination == Termination.ANSWERED and traj.reward == 1.0 and traj.error is None
    results = [s.info["tool_results"][0] for s in traj.steps[:-1]]
    assert [r["error"] for r in results] == [*ATTACKS.values(), None]
    assert results[-1]["output"] == "42"
    for kind in set(ATTACKS.values()):
        assert traj.metrics[f"tool_errors/{kind}"] == 1.0
    assert traj.metrics["tool_errors"] == len(ATTACKS)
    seen = {r["error"]: r["output"] for r in results}
    assert "CPU time limit" in seen["cpu_limit"] and "3 s limit" in seen["timeout"]
    assert "MemoryError" in seen["memory_limit"] and "bytes printed in all" in seen["output_limit"]
    assert "BlockingIOError" in seen.get("exception", "BlockingIOError")  # the fork bomb, where it ran
    assert not sandbox_processes()  # the env was closed: no interpreter left


async def test_bad_arguments_are_the_usual_invalid_arguments_error():
    tool = python_tool(LIMITS)
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
