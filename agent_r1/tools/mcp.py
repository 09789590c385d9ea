"""Tools served over the Model Context Protocol, next to `@tool` functions in the same `ToolEnv`.

`MCPServer(command=[...])` starts a server as a subprocess and talks to it over stdio;
`MCPServer(url="http://host:port/mcp")` joins one over streamable HTTP. Both go through the official
`mcp` SDK's `Client`. `server.tools()` lists the server's tools, with their JSON schemas, as
ordinary `Tool`s, so arguments are validated locally (a bad call never reaches the server), and
timeouts, output caps and error observations are the same as for any other tool.

One connection per server and process serves every episode (the rollout loop runs many at once).
It lives on a background thread with its own event loop, because the SDK's sessions are bound to
the loop that opened them, and the trainer opens a fresh loop for each rollout. A server that dies
or drops the connection turns the calls in flight into `unavailable` error observations; the next
call reconnects (a stdio server is started again).

Use it in a task's `make_env` (the first call connects, and a server that cannot be reached is a
one-line error there):

    SEARCH = MCPServer(command=["python", "my_search_server.py"])

    def make_env(options, prompt_format, max_turns):
        return ToolEnv({**SEARCH.tools(), "python": python_tool()}, prompt_format, reward, max_turns=max_turns)
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import importlib.util
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from agent_r1.tools.base import TOOL_NAME_RE, Tool, ToolResult

log = logging.getLogger(__name__)


class MCPServer:
    """The tools of one MCP server (a stdio `command` or a streamable-HTTP `url`), as `Tool`s."""

    def __init__(
        self,
        command: list[str] | None = None,
        *,
        url: str | None = None,
        env: Mapping[str, str] | None = None,
        prefix: str = "",
        timeout: float = 30.0,
        connect_timeout: float = 30.0,
    ) -> None:
        if (command is None) == (url is None):
            raise ValueError("MCPServer needs exactly one of command=[...] (stdio) or url=... (streamable HTTP)")
        if command is not None and (not command or not all(isinstance(c, str) for c in command)):
            raise ValueError(f"MCPServer command must be a non-empty list of strings, got {command!r}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("MCPServer timeout and connect_timeout must be positive")
        if importlib.util.find_spec("mcp") is None:
            raise ImportError("MCPServer needs the official MCP SDK: pip install 'agent-r1[tools]'")
        self.command, self.url, self.env = command, url, dict(env) if env is not None else None
        self.prefix, self.timeout, self.connect_timeout = prefix, timeout, connect_timeout
        self.label = url or " ".join(command or [])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None  # the SDK's Client while connected, else None
        self._stop: asyncio.Event | None = None  # set to close the current connection
        self._connecting: asyncio.Future | None = None
        self._tools: dict[str, Tool] | None = None
        self._lock = threading.Lock()

    def tools(self) -> dict[str, Tool]:
        """The server's tools by (prefixed) name; connects on the first call, then cached."""
        with self._lock:
            if self._tools is None:
                listed = self._run(self._connect(), self.connect_timeout, "could not connect")
                self._tools = {t.name: t for t in (self._tool(spec) for spec in listed) if t is not None}
        return self._tools

    def close(self) -> None:
        """Close the connection (a stdio server exits) and stop the background loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(Exception):  # a connection already gone must not raise at exit
            asyncio.run_coroutine_threadsafe(self._disconnect(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._loop = None

    # -- the background loop -------------------------------------------------------------------------

    def _run(self, coro: Any, timeout: float, what: str) -> Any:
        """Run `coro` on the background loop from a synchronous caller; failures are one line."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="agent-r1-mcp", daemon=True).start()
            atexit.register(self.close)
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ConnectionError(f"MCP server {self.label}: {what} within {timeout:g}s") from None
        except Exception as exc:
            raise ConnectionError(f"MCP server {self.label}: {what}: {_describe(exc)}") from None

    async def _connect(self) -> list[Any]:
        """Open the connection in a task that holds it (the SDK's scopes must close where they opened),
        and return the server's tool listing once it is up."""
        if self._connecting is not None and not self._connecting.done():
            return await asyncio.shield(self._connecting)
        self._connecting = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        asyncio.get_running_loop().create_task(self._hold(self._connecting, self._stop))
        return await asyncio.shield(self._connecting)

    async def _hold(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters

        target: Any = self.url
        if self.command is not None:
            target = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env)
        try:
            async with Client(target, read_timeout_seconds=self.timeout + 5) as client:
                listed, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    listed += page.tools
                    if not (cursor := page.next_cursor):
                        break
                self._client = client
                ready.set_result(listed)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else ConnectionError(str(exc)))
        finally:
            if self._stop is stop:
                self._client = None

    async def _disconnect(self) -> None:
        if self._stop is not None:
            self._stop.set()
        self._client = None

    async def _call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """One tool call on the background loop; a dead connection is reported, then reopened next time.

        Reopening (a stdio server's start-up) counts against `connect_timeout`, not the call's own
        `timeout`: a server that starts slowly on a loaded machine is not a tool that runs too long."""
        try:
            if self._client is None:
                await asyncio.wait_for(self._connect(), self.connect_timeout)
            try:
                async with asyncio.timeout(self.timeout) as deadline:
                    result = await self._client.call_tool(name, arguments, read_timeout_seconds=self.timeout + 5)
            except TimeoutError:
                if not deadline.expired():  # the SDK's own (a write to a wedged transport): a dead connection
                    raise
                message = f"Error: tool {self.prefix + name} timed out after {self.timeout:g}s"
                return ToolResult(message, error="timeout")
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except BaseException as exc:
            await self._disconnect()
            return ToolResult(f"Error: MCP server {self.label} is unavailable: {_describe(exc)}", error="unavailable")
        text = _content_text(result)
        if result.is_error:
            return ToolResult(f"Error: {text}", error="exception")
        return ToolResult(text)

    def _tool(self, spec: Any) -> Tool | None:
        """A `Tool` for one listed MCP tool, or None (with a warning) when its name or schema is unusable."""
        name = self.prefix + spec.name
        if not TOOL_NAME_RE.match(name):
            log.warning(f"MCP server {self.label}: tool {name!r} skipped (names must match {TOOL_NAME_RE.pattern})")
            return None

        async def call(**arguments: Any) -> ToolResult:
            assert self._loop is not None
            future = asyncio.run_coroutine_threadsafe(self._call(spec.name, arguments), self._loop)
            return await asyncio.wrap_future(future)  # cancelled by the tool deadline: cancels the call too

        schema = spec.input_schema or {"type": "object", "properties": {}}
        try:
            # The call's own deadline is in `_call`; this one also covers reopening a dead connection.
            deadline = self.timeout + self.connect_timeout + 10  # + the cancelled call's courtesy notice
            return Tool(name, spec.description or "", schema, call, timeout=deadline)
        except Exception as exc:  # a schema jsonschema rejects
            log.warning(f"MCP server {self.label}: tool {name!r} skipped: {_describe(exc)}")
            return None


def _content_text(result: Any) -> str:
    """An MCP result as the text the model reads: text parts, then placeholders for the rest."""
    parts = []
    for item in result.content:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and hasattr(item.resource, "text"):
            parts.append(item.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource: {item.uri}]")
        else:
            parts.append(f"[{kind or 'content'}: {getattr(item, 'mime_type', '') or 'not shown'}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _describe(exc: BaseException) -> str:
    """One line for an exception, looking inside exception groups (anyio wraps transport failures)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
