"""The `python` tool: a code interpreter for the model, each trajectory in its own sandbox.

Agents that compute by writing code (ReTool, Feng et al. 2025; TableMind; SkyRL-gym's and verl's
SandboxFusion tools) call a Python interpreter and read what it prints. `python_tool()` makes one
such tool per episode (call it in your task's `make_env`): a `PythonSandbox` (see
`agent_r1.tools.sandbox` for what is enforced) behind the usual `Tool` contract, so its failures are
observations the model reads and error kinds the trainer counts (`tool_errors/timeout`,
`tool_errors/memory_limit`, ...), never a crashed run. `ToolEnv.close()` kills the interpreter and
deletes the scratch directory when the episode ends.
"""

from __future__ import annotations

from agent_r1.tools.base import Tool, ToolResult
from agent_r1.tools.sandbox import CellResult, Isolation, PythonSandbox, SandboxLimits

DESCRIPTION = "Run Python code and return what it prints (stdout and stderr) and the value of its last expression."
_MAX_ERROR_CHARS = 2000  # the end of a traceback is the informative part


def python_tool(
    limits: SandboxLimits | None = None,
    *,
    isolation: Isolation = "bwrap",
    persistent: bool = False,
    name: str = "python",
) -> Tool:
    """A `python` tool with a fresh sandbox: one per episode, since the scratch directory (and, with
    `persistent=True`, the variables) belong to one trajectory. Its description is the same whatever the
    isolation: the prompt a policy is trained on does not change with the machine it runs on."""
    limits = limits or SandboxLimits()
    sandbox = PythonSandbox(limits, isolation=isolation, persistent=persistent)
    state = "Variables persist between calls." if persistent else "Each call starts a fresh interpreter."

    async def run_python(code: str) -> ToolResult:
        had_state = sandbox.had_state
        result = await sandbox.run(code)
        restarted = had_state and result.kind in ("timeout", "killed")
        return ToolResult(observation(result, restarted), error=result.kind)

    return Tool(
        name=name,
        description=f"{DESCRIPTION} {state}",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python code to run"}},
            "required": ["code"],
        },
        fn=run_python,
        # a backstop only: the sandbox enforces wall_seconds itself, and starting it takes a moment
        timeout=limits.wall_seconds + 30,
        max_output_chars=limits.max_output_chars + _MAX_ERROR_CHARS + 200,
        close=sandbox.aclose,
    )


def observation(result: CellResult, restarted: bool = False) -> str:
    """What the model reads: the output (with how much was cut), then the error, then what was lost."""
    parts = [result.output.rstrip("\n")] if result.output.strip() else []
    if result.size > len(result.output.encode()):
        parts.append(f"...[output cut: {result.size} bytes printed in all]")
    if result.error:
        error = result.error if len(result.error) <= _MAX_ERROR_CHARS else "..." + result.error[-_MAX_ERROR_CHARS:]
        parts.append(error if result.kind in ("exception", "memory_limit") else f"Error: {error}")
    if restarted:
        parts.append("The interpreter was restarted: variables from earlier calls are gone (files remain).")
    return "\n".join(parts) or "(no output: print() what you want to see)"
