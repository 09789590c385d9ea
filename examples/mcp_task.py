"""Questions answered with the tools of any MCP server, plus a sandboxed python tool, in one file.

    agent-r1 train task=examples/mcp_task.py task.server="python my_server.py" task.data=questions.jsonl
    agent-r1 eval  task=examples/mcp_task.py task.url=http://localhost:8000/mcp task.data=questions.jsonl

Every tool the server lists is offered with the server's own schema. The reward is 1 when the
`<answer>` matches the row's answer: numerically for a JSON number, else after SQuAD normalisation.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from agent_r1.data import load_tasks
from agent_r1.env.tool_calls import extract_answer
from agent_r1.env.tool_env import ToolEnv
from agent_r1.rewards import numeric_match
from agent_r1.rewards.qa import exact_match
from agent_r1.tools import python_tool
from agent_r1.tools.mcp import MCPServer


@dataclass
class Options:
    server: str = ""
    """the command that starts a stdio MCP server (split like a shell line)"""
    url: str = ""
    """or the URL of a streamable-HTTP MCP server"""
    data: str = ""
    """jsonl of {"question", "answer"} rows (the same rows for every split)"""
    python: bool = True
    """offer a sandboxed python tool next to the server's tools"""
    timeout: float = 30.0
    """seconds per MCP tool call"""

    def __post_init__(self) -> None:
        if bool(self.server) == bool(self.url):
            raise ValueError("give exactly one of task.server (a command) or task.url")
        if not self.data:
            raise ValueError("task.data must name a jsonl file of question/answer rows")


_SERVERS: dict[tuple[str, str], MCPServer] = {}  # one connection per process, shared by every episode


def server(options: Options) -> MCPServer:
    key = (options.server, options.url)
    if key not in _SERVERS:
        command = shlex.split(options.server) if options.server else None
        _SERVERS[key] = MCPServer(command, url=options.url or None, timeout=options.timeout)
    return _SERVERS[key]


def tasks(options: Options, split: str, n: int, seed: int = 0) -> list[dict]:
    return load_tasks(options.data)[:n]


def reward(task: dict, text: str) -> float:
    answer, gold = extract_answer(text), task["answer"]
    if answer is None:
        return 0.0
    return numeric_match(answer, gold) if isinstance(gold, int | float) else exact_match(answer, str(gold))


def make_env(options: Options, prompt_format, max_turns: int = 4) -> ToolEnv:
    tools = {**server(options).tools(), **({"python": python_tool()} if options.python else {})}
    return ToolEnv(tools, prompt_format, reward, max_turns=max_turns,
                   instructions="Use the tools, then give the final answer inside <answer></answer>.")  # fmt: skip
