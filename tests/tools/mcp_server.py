"""A real MCP server for the tests, built with the official SDK: `python mcp_server.py stdio` or
`python mcp_server.py http PORT`. Its tools cover success, a server-side error, slowness and death."""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("agent-r1-test")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(message: str) -> str:
    """Fail with this message (a ToolError is reported to the client as it is)."""
    raise ToolError(message)


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def die() -> str:
    """End the server process at once, as a crash would."""
    os._exit(3)


@server.tool()
def pid() -> int:
    """The server's process id (tests tell a restarted server apart)."""
    return os.getpid()


if __name__ == "__main__":
    time.sleep(float(os.environ.get("MCP_TEST_START_SECONDS", "0")))  # a server slow to start (a loaded machine)
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", port=int(sys.argv[2]))
