"""The gateway's HTTP side: one OpenAI-compatible server per process, with routes scoped to an episode.

    POST /episodes/{episode_id}/v1/chat/completions   the agent program asks the policy (one request at a time)
    POST /episodes/{episode_id}/v1/messages           the same, in Anthropic's Messages API
    POST /episodes/{episode_id}/v1/messages/count_tokens
    POST /episodes/{episode_id}/v1/responses          the same, in OpenAI's Responses API
    GET  /episodes/{episode_id}/v1/models             one model card (any model name is accepted)
    POST /episodes/{episode_id}/reward                the program reports its reward: {"reward": float}
    GET  /health

The server is started on first use, on 127.0.0.1 and a free port, in a daemon thread with its own event
loop, and is shared by every episode of the process. It does no model work: a chat request is checked
(episode, API key, `n`, one request in flight) and handed to the episode's `ProgramEnv`
through its `Mailbox`. The env renders it into the next observation, the rollout loop samples, and the
env's answer is what this request returns. A Messages or Responses request is the chat request it means
(agent_r1/api/anthropic.py, responses.py), so every protocol is one step of the same kind and merges the
same way; `previous_response_id` refers to the episode's own responses only. Every failure is an error body
in the route's protocol (Anthropic's on the Messages routes, OpenAI's elsewhere). The program's key is
accepted as a bearer token (OpenAI SDK) or as `x-api-key` (Anthropic SDK).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from agent_r1.api import anthropic, bodies, responses
from agent_r1.api.http import install_error_handlers, off_loop, sse
from agent_r1.api.responses import ResponseStore
from agent_r1.api.schema import APIError, ChatCompletionRequest

MODEL_NAME = "agent-r1-policy"  # what /v1/models lists; a request may name any model, it is the policy either way
MAX_N = 16  # answers one request may ask for: n samples of one step cost n times one answer's decoding


class GatewayChatRequest(ChatCompletionRequest):
    """A chat request as the SDKs send it; `n` is checked here (with a message that says why), `tool_choice`
    and `response_format` when the episode renders it (a forced call and JSON are sampled under a grammar,
    which the step records for the update)."""

    n: int = 1


class RewardReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(allow_inf_nan=False)


@dataclass
class Call:
    """One chat request waiting for the policy's answer: a chat.completion dict, or an APIError."""

    body: GatewayChatRequest
    answer: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def reply(self, result: dict[str, Any] | APIError) -> None:
        """Answer once; a request whose client went away (its future cancelled) is answered into the void."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.answer.set_result(result)


@dataclass
class Unseen:
    """The program's connection closed before the answer to `call` reached it: the answer changed nothing the
    program did, so the step is kept as context and not trained (rollout/merge.py)."""

    call: Call


@dataclass
class Mailbox:
    """One episode's link between the server thread and the env's event loop."""

    id: str
    token: str  # the program's OPENAI_API_KEY: only the episode's own program is answered
    loop: asyncio.AbstractEventLoop  # the env's loop; `inbox` belongs to it
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # Call, or the env's own events (program exit)
    # the chat request in flight, and an event set when there is none (the server's loop only)
    asking: Request | None = None
    free: asyncio.Event = field(default_factory=asyncio.Event)
    reward: float | None = None  # the last reward the program posted
    max_reward: float = math.inf  # a posted reward beyond +-this is refused (the task's bound)
    closed: bool = False  # the env closed the episode (read and written on the env's loop only)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(256))  # this episode's, by id
    count_tokens: Callable[[GatewayChatRequest], int] | None = None  # the env's rendering, for count_tokens

    def put(self, event: Any) -> bool:
        """Deliver `event` to the env from any thread; False once the env's loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop is closed: the episode is over
            return False
        return True

    def _deliver(self, event: Any) -> None:
        if not self.closed:
            self.inbox.put_nowait(event)
        elif isinstance(event, Call):  # it arrived as the episode closed: answered, never left waiting
            event.reply(self.ended())

    def ended(self) -> APIError:
        return APIError(410, f"episode {self.id!r} has ended", code="episode_ended")


class Gateway:
    """The process's gateway server and its open episodes."""

    def __init__(self) -> None:
        self._mailboxes: dict[str, Mailbox] = {}
        self._lock = threading.Lock()
        sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self), log_level="warning", access_log=False, timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name="agent-r1-gateway"
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent-r1 gateway server did not start")
            time.sleep(0.005)

    def base_url(self, mailbox: Mailbox) -> str:
        """The OPENAI_BASE_URL of an episode."""
        return f"http://127.0.0.1:{self.port}/episodes/{mailbox.id}/v1"

    def reward_url(self, mailbox: Mailbox) -> str:
        """Where the program may POST {"reward": float}."""
        return f"http://127.0.0.1:{self.port}/episodes/{mailbox.id}/reward"

    def open(self) -> Mailbox:
        """Register a new episode, bound to the calling coroutine's event loop."""
        mailbox = Mailbox(uuid.uuid4().hex, secrets.token_urlsafe(24), asyncio.get_running_loop())
        with self._lock:
            self._mailboxes[mailbox.id] = mailbox
        return mailbox

    def close(self, mailbox: Mailbox) -> None:
        """Forget an episode: its routes answer 404 from now on."""
        with self._lock:
            self._mailboxes.pop(mailbox.id, None)

    def mailbox(self, episode_id: str, request: Request) -> Mailbox:
        """The open episode `episode_id`, if the request carries its API key; else a 404 or a 401."""
        with self._lock:
            mailbox = self._mailboxes.get(episode_id)
        if mailbox is None:
            raise APIError(
                404, f"unknown episode {episode_id!r}: it has ended or never existed", code="episode_not_found"
            )
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not secrets.compare_digest(key.encode(), mailbox.token.encode()):
            raise APIError(
                401, f"wrong API key for episode {episode_id!r}: send the key the gateway gave the program "
                "(OPENAI_API_KEY as a bearer token, or ANTHROPIC_API_KEY as x-api-key)",
                type="authentication_error", code="invalid_api_key",
            )  # fmt: skip
        return mailbox


_GATEWAY: Gateway | None = None
_GATEWAY_PID = 0
_START = threading.Lock()


def gateway() -> Gateway:
    """This process's gateway server, started on first use (again in a forked child, whose copy has no thread)."""
    global _GATEWAY, _GATEWAY_PID
    with _START:
        if _GATEWAY is None or os.getpid() != _GATEWAY_PID:
            _GATEWAY, _GATEWAY_PID = Gateway(), os.getpid()
        return _GATEWAY


def create_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="agent-r1 gateway", summary="an agent program's OpenAI API, answered by the policy in training")
    install_error_handlers(app, 8 * 2**20)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "episodes": len(gw._mailboxes)}

    @app.get("/episodes/{episode_id}/v1/models")
    async def models(episode_id: str, request: Request) -> dict[str, Any]:
        gw.mailbox(episode_id, request)
        return bodies.model_list({"id": MODEL_NAME, "created": 0})

    @app.post("/episodes/{episode_id}/reward")
    async def reward(episode_id: str, body: RewardReport, request: Request) -> dict[str, Any]:
        mailbox = gw.mailbox(episode_id, request)
        if abs(body.reward) > mailbox.max_reward:
            bound = f"[-{mailbox.max_reward:g}, {mailbox.max_reward:g}]"
            raise APIError(400, f"reward {body.reward:g} is outside {bound} (task.max_reward)", param="reward")
        mailbox.reward = body.reward
        return {"reward": body.reward}

    async def ask(mailbox: Mailbox, body: GatewayChatRequest, request: Request) -> dict[str, Any]:
        """The policy's chat.completion for `body`: the episode's next step. A client that went away while the
        policy answered (a timeout, a killed sub-process) never sees it: the env is told (`Unseen`)."""
        _check(body)
        if mailbox.asking is not None and await mailbox.asking.is_disconnected():
            while mailbox.asking is not None:  # a retry after its client gave up: after that answer, in order
                await mailbox.free.wait()
        if mailbox.asking is not None:
            raise APIError(
                409, f"episode {mailbox.id!r} already has a chat request in flight: an episode asks the policy one "
                "request at a time (each request is one step), so wait for the answer before sending the next",
                code="request_in_flight",
            )  # fmt: skip
        call = Call(body)
        mailbox.asking = request
        mailbox.free.clear()
        try:
            if not mailbox.put(call):
                raise APIError(404, f"unknown episode {mailbox.id!r}: it has ended", code="episode_not_found")
            result = await asyncio.wrap_future(call.answer)
            if not isinstance(result, APIError) and await request.is_disconnected():
                mailbox.put(Unseen(call))  # still in flight: it reaches the env before the program's next request
        finally:
            mailbox.asking = None
            mailbox.free.set()
        if isinstance(result, APIError):
            raise result
        return result

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat(episode_id: str, body: GatewayChatRequest, request: Request) -> Any:
        result = await ask(gw.mailbox(episode_id, request), body, request)
        if not body.stream:
            return result
        return sse(bodies.chat_chunks(result, bool((body.stream_options or {}).get("include_usage"))))

    @app.post("/episodes/{episode_id}/v1/messages")
    async def messages(episode_id: str, body: anthropic.MessagesRequest, request: Request) -> Any:
        mailbox = gw.mailbox(episode_id, request)
        result = await ask(mailbox, anthropic.to_chat(body, GatewayChatRequest), request)
        if not body.stream:
            return anthropic.message(result)
        events = anthropic.events(bodies.chat_chunks(result, True), result["model"], result["usage"]["prompt_tokens"])
        return sse(events, "messages")

    @app.post("/episodes/{episode_id}/v1/messages/count_tokens")
    async def count_tokens(episode_id: str, body: anthropic.CountTokensRequest, request: Request) -> dict[str, int]:
        mailbox = gw.mailbox(episode_id, request)
        if mailbox.count_tokens is None:
            raise APIError(503, f"episode {episode_id!r} is not ready to count tokens yet")
        return {"input_tokens": await off_loop(mailbox.count_tokens, anthropic.to_chat(body, GatewayChatRequest))}

    @app.post("/episodes/{episode_id}/v1/responses")
    async def responses_(episode_id: str, body: responses.ResponsesRequest, request: Request) -> Any:
        mailbox = gw.mailbox(episode_id, request)
        history = mailbox.responses.history(body.previous_response_id)
        result = await ask(mailbox, responses.to_chat(body, history, GatewayChatRequest, MODEL_NAME), request)
        response_id = responses.new_id()

        def keep(output: list[dict[str, Any]]) -> None:
            if body.store:
                mailbox.responses.put(response_id, [*history, *responses.input_items(body), *output])

        if body.stream:
            chunks = bodies.chat_chunks(result, True)
            return sse(responses.events(chunks, body, response_id, result["model"], keep), "responses")
        answer = responses.from_completion(body, response_id, result)
        keep(answer["output"])
        return answer

    return app


def _check(body: GatewayChatRequest) -> None:
    """What the gateway refuses before the episode sees the request: a 400 naming the field and why."""
    if not 1 <= body.n <= MAX_N:
        raise APIError(
            400, f"n={body.n} is out of range: a request may ask for 1 to {MAX_N} answers (each is sampled by the "
            "policy in training, so the cap bounds what one program can ask of the rollout)",
            param="n",
        )  # fmt: skip
