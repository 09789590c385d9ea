"""MCP tools from a real server (the official SDK's, started by the test) over stdio and streamable HTTP:
schemas come from the server, calls run next to `@tool` functions, and every failure (a bad call, a
server-side error, a slow call, a server that dies) is an observation, never a crash."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.tools import echo, execute_tool_call
from agent_r1.tools.mcp import MCPServer
from agent_r1.types import Termination
from tests.rollout.test_agent_loop import ScriptedEngine

SERVER = str(Path(__file__).with_name("mcp_server.py"))


@pytest.fixture(scope="module")
def stdio():
    server = MCPServer(command=[sys.executable, SERVER, "stdio"], timeout=2)
    yield server
    server.close()


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_the_servers_tools_and_schemas_become_tools(stdio):
    tools = stdio.tools()
    assert set(tools) == {"add", "fail", "slow", "die", "pid"}
    add = tools["add"]
    assert add.description == "Add two integers."
    assert add.parameters["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in add.parameters["properties"].items()} == {"a": "integer", "b": "integer"}
    assert stdio.tools() is tools  # listed once per process


def test_an_episode_uses_mcp_tools_next_to_a_python_tool(stdio, tokenizer):
    tools = {**stdio.tools(), "echo": echo}
    script = [call("add", {"a": 20, "b": 22}) + call("echo", {"text": "hi"}), "<answer>42</answer>"]

    def env():
        return ToolEnv(tools, ChatFormat(tokenizer), lambda task, text: float("42" in text))

    (traj,) = AgentEnvLoop(ScriptedEngine(tokenizer, script), env, SamplingParams()).run_sync([{"question": "q"}])
    assert traj.termination == Termination.ANSWERED and traj.reward == 1.0
    assert [r["output"] for r in traj.steps[0].info["tool_results"]] == ["42", "hi"]
    assert '"name": "add"' in env().system  # the model is shown the server's schema


async def test_failures_are_observations(stdio):
    tools = stdio.tools()
    bad = await execute_tool_call(tools, "add", {"a": "one", "b": 2})  # checked here, never sent
    assert bad.error == "invalid_arguments" and "'one' is not of type 'integer'" in bad.output
    failed = await execute_tool_call(tools, "fail", {"message": "no such city"})
    assert failed.error == "exception" and failed.output.endswith("no such city")  # the server's message
    slow = await execute_tool_call(tools, "slow", {"seconds": 10})
    assert slow.error == "timeout" and slow.seconds < 4
    assert (await execute_tool_call(tools, "add", {"a": 1, "b": 2})).output == "3"  # still serving


async def test_a_dead_stdio_server_is_an_observation_then_restarted(stdio):
    tools = stdio.tools()
    before = (await execute_tool_call(tools, "pid", {})).output
    dead = await execute_tool_call(tools, "die", {})
    assert dead.error == "unavailable" and "is unavailable" in dead.output and "\n" not in dead.output
    after = await execute_tool_call(tools, "pid", {})
    assert after.error is None and after.output != before  # a new server process answered


async def test_a_restart_slower_than_the_call_timeout_still_answers():
    """On a loaded machine (CI's two workers) a stdio server took longer to start again than the call's
    2 s timeout, and the call after a crash timed out. Starting counts against connect_timeout instead:
    here the server takes 4 s to start and a call may take 2."""
    server = MCPServer(command=[sys.executable, SERVER, "stdio"], env={"MCP_TEST_START_SECONDS": "4"}, timeout=2)
    try:
        tools = server.tools()
        before = (await execute_tool_call(tools, "pid", {})).output
        assert (await execute_tool_call(tools, "die", {})).error == "unavailable"
        after = await execute_tool_call(tools, "pid", {})
        assert after.error is None and after.output != before and after.seconds > 4
        slow = await execute_tool_call(tools, "slow", {"seconds": 10})  # the call itself still has 2 s
        assert slow.error == "timeout" and slow.output == "Error: tool slow timed out after 2s"
    finally:
        server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_http(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the MCP test server did not start")


async def test_streamable_http_server_that_dies_and_comes_back():
    port = free_port()
    proc = start_http(port)
    server = MCPServer(url=f"http://127.0.0.1:{port}/mcp", timeout=2)
    try:
        tools = server.tools()
        assert (await execute_tool_call(tools, "add", {"a": 2, "b": 3})).output == "5"
        proc.kill()
        proc.wait()
        down = await execute_tool_call(tools, "add", {"a": 2, "b": 3})
        assert down.error == "unavailable" and "\n" not in down.output
        proc = start_http(port)
        assert (await execute_tool_call(tools, "add", {"a": 2, "b": 3})).output == "5"  # reconnected
    finally:
        server.close()
        proc.kill()


def test_bad_configuration_is_one_line():
    with pytest.raises(ValueError, match="exactly one of command"):
        MCPServer()
    with pytest.raises(ValueError, match="non-empty list of strings"):
        MCPServer(command=[])
    with pytest.raises(ConnectionError, match=r"^MCP server http://127.0.0.1:\d+/mcp: could not connect") as err:
        MCPServer(url=f"http://127.0.0.1:{free_port()}/mcp", connect_timeout=5).tools()
    assert "\n" not in str(err.value)
    with pytest.raises(ConnectionError, match="could not connect") as err:
        MCPServer(command=[sys.executable, "-c", "import sys; sys.exit(1)"], connect_timeout=5).tools()
    assert "\n" not in str(err.value)
