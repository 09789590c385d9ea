"""Tools the model can call: `@tool` turns a typed, documented function into one.

`BUILTIN_TOOLS` is a plain dict, not a registry: pass any `{name: Tool}` mapping to an env.
`python_tool()` makes a sandboxed code interpreter, one per episode (it owns a process).
"""

from agent_r1.tools.base import Tool, ToolCallResult, ToolResult, execute_tool_call, tool
from agent_r1.tools.calculator import calculator
from agent_r1.tools.echo import echo
from agent_r1.tools.python import python_tool
from agent_r1.tools.sandbox import PythonSandbox, SandboxLimits, check_sandbox

BUILTIN_TOOLS: dict[str, Tool] = {t.name: t for t in (calculator, echo)}

__all__ = [
    "BUILTIN_TOOLS",
    "PythonSandbox",
    "SandboxLimits",
    "Tool",
    "ToolCallResult",
    "ToolResult",
    "calculator",
    "check_sandbox",
    "echo",
    "execute_tool_call",
    "python_tool",
    "tool",
]
