"""The HTTP plumbing of agent-r1's OpenAI-compatible servers (`agent-r1 serve` and the gateway): every failure
as an OpenAI-style `{"error": {...}}` body, a request-body size limit, server-sent events, and rendering
prompts off the event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage

from agent_r1.api import anthropic, responses
from agent_r1.api.schema import APIError

_RENDER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="agent-r1-tokenize")


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run fn (rendering and tokenizing a prompt) in a thread: a prompt of megabytes takes seconds, and on
    the event loop it would freeze every stream, health check and (in the gateway) every other episode
    of the rollout meanwhile. The pool is its own, so it never takes the threads the engine decodes in."""
    return await asyncio.get_running_loop().run_in_executor(_RENDER, fn, *args)


def install_error_handlers(app: FastAPI, max_request_bytes: int) -> None:
    """Bad input becomes a 4xx with an OpenAI-style body, anything else a 500 naming the exception, and a
    body over `max_request_bytes` a 413 before it is read whole."""
    app.add_middleware(BodyLimit, limit=max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        err = exc.error if isinstance(exc, TooLarge) else APIError(exc.status_code, str(exc.detail))
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(server_error(exc), request.url.path)


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 list of problems -> one OpenAI-style 400 naming the first one."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}")
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    if not loc:
        return APIError(400, "request body must be a JSON object")
    return APIError(400, f"{loc}: {first.get('msg', 'invalid value')}", param=loc)


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """The error in the protocol of the route it answers: Anthropic's body on the Messages routes, else OpenAI's."""
    body = anthropic.error_body(err) if is_messages(path) else err.body()
    return JSONResponse(body, status_code=err.status)


def is_messages(path: str) -> bool:
    """Whether `path` is an Anthropic Messages route (`/v1/messages`, `/v1/messages/count_tokens`)."""
    return path.endswith(("/v1/messages", "/v1/messages/count_tokens"))


def server_error(exc: Exception) -> APIError:
    return APIError(500, f"{type(exc).__name__}: {exc}"[:500], type="server_error")


def sse(events: AsyncIterator[dict], protocol: str = "chat") -> StreamingResponse:
    """Server-sent events. Chat and completions (`protocol="chat"`): one `data: {json}` per event, an error
    event if generation fails or times out midway (the status line is already sent), then `data: [DONE]`.
    Anthropic Messages and OpenAI Responses ("messages", "responses"): each event named by its `type`
    (`event: message_start`), their own error event, no [DONE]."""

    def line(event: dict) -> str:
        named = f"event: {event['type']}\n" if protocol != "chat" else ""
        return f"{named}data: {json.dumps(event)}\n\n"

    failed = {"chat": APIError.body, "messages": anthropic.error_body, "responses": responses.error_event}[protocol]

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield line(event)
        except APIError as exc:
            yield line(failed(exc))
        except Exception as exc:  # the engine failed mid-stream: tell this client, keep serving the rest
            yield line(failed(server_error(exc)))
        if protocol == "chat":
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is a 413. A Content-Length over it is refused
    before a byte is read; a chunked body is counted as it arrives and refused once it passes the limit,
    so at most `limit` bytes (plus one chunk) are ever held."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            too_large = error_response(self._too_large(f"{int(length)} bytes"), scope.get("path", ""))
            return await too_large(scope, receive, send)
        seen = 0

        async def counted() -> ASGIMessage:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise TooLarge(self._too_large(f"more than {self.limit} bytes"))
            return message

        await self.app(scope, counted, send)

    def _too_large(self, size: str) -> APIError:
        return APIError(
            413, f"the request body ({size}) is over this server's limit of {self.limit} bytes (max_request_mb)",
            code="request_too_large",
        )  # fmt: skip


class TooLarge(HTTPException):
    """Raised while the body is read: FastAPI turns any other exception there into a generic 400, but
    lets an HTTPException through to the handler, which answers with `error`."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error
