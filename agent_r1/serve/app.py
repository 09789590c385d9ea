"""`create_app`: an OpenAI-compatible HTTP API over a `LocalEngine`, which makes it a rollout engine too.

* `/v1/chat/completions` renders messages with the model's prompt format and the same hermes tools
  system prompt `ToolEnv` trains with, stops at `</tool_call>` as training rollouts do, and returns the
  calls as OpenAI `tool_calls`. `stream=true` sends server-sent events.
* `/v1/completions` takes token ids and returns token ids and log-probs (vLLM's field names), so
  `RemoteEngine` can drive it exactly like vLLM.
* `/v1/load_weights` swaps in new weights from a safetensors file between two batches (the engine's
  weight lock), so a trainer pushes its policy after every optimizer step (`RemoteEngine.sync_weights`);
  with `between_tokens` at the next token boundary instead, running requests going on with the new
  weights (asynchronous RL's partial rollouts). Choices that return `token_ids` also return
  `token_versions`, the weights version that sampled each token, so a client sees which came from which.

Every request goes through the engine's queue, so concurrent requests are decoded as one batch. Each
has a deadline, and a client that goes away (or times out) cancels its generation: the engine drops
its row at the next token. Bad input never reaches the engine: it becomes a 4xx with an OpenAI-style
`{"error": {...}}` body, and the server keeps serving. A body over `max_request_bytes` is a 413
before it is read whole, and prompts are rendered and tokenized off the event loop, so one huge
request neither fills the memory nor stalls every other client's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage
from transformers import PreTrainedTokenizerBase

from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    ParsedCall,
    format_tool_call,
    format_tool_responses,
    parse_tool_calls,
    tools_system_prompt,
)
from agent_r1.models.vision import image_parts
from agent_r1.rollout.engine import GenerateOutput, SamplingParams
from agent_r1.rollout.local_engine import LocalEngine
from agent_r1.rollout.text_stream import TextStream, visible_prefix
from agent_r1.serve.schema import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    LoadWeightsRequest,
    ToolSpec,
)
from agent_r1.tools import Tool
from agent_r1.types import Image, Message


@dataclass
class ServedModel:
    """Everything the API needs to know about the one model it serves."""

    engine: LocalEngine
    tokenizer: PreTrainedTokenizerBase
    prompt_format: PromptFormat
    name: str  # the id clients put in "model"
    request_timeout: float = 300.0  # seconds before a request is cancelled and answered with a 504
    default_max_tokens: int = 512  # chat completions without max_tokens get at most this many
    allow_weight_updates: bool = False  # /v1/load_weights replaces the model: only for a trainer's own server
    max_request_bytes: int = 8 * 2**20  # a larger body is a 413, refused before it is held in memory
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(served: ServedModel) -> FastAPI:
    """The FastAPI app; run it with uvicorn (`agent-r1 serve`) or call it in-process in tests."""
    api = _API(served)
    app = FastAPI(title="agent-r1", summary="OpenAI-compatible API and rollout engine")
    app.add_middleware(_BodyLimit, limit=served.max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error_response(exc.error if isinstance(exc, _TooLarge) else APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(_server_error(exc))

    app.get("/health")(lambda: {"status": "ok", "generating": api.generating})
    app.get("/v1/models")(api.models)
    app.post("/v1/chat/completions")(api.chat)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/load_weights")(api.load_weights)
    return app


class _API:
    def __init__(self, served: ServedModel) -> None:
        self.s = served
        self.eos_ids = served.engine.eos_ids
        self._loading = asyncio.Lock()  # one weight load at a time: one extra copy of the weights in memory
        self.generating = 0  # requests queued or decoding; /health shows it, so a leaked one is visible

    # --- endpoints -----------------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        s = self.s
        card = {"id": s.name, "object": "model", "created": s.created, "owned_by": "agent-r1"}
        extra = {"max_model_len": s.engine.max_context, "weights_version": s.engine.weights_version}
        return {"object": "list", "data": [card | extra]}

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        _check_unicode(body)
        tools = _tool_schemas(body.tools) if body.tools and body.tool_choice != "none" else []
        prompt, images = await _off_loop(self._chat_prompt, _template_messages(body.messages, tools))
        stops = body.stops + tuple(self.s.prompt_format.stop)
        max_tokens = self._budget(len(prompt), body.max_completion_tokens or body.max_tokens, "messages")
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            stop=((CALL_CLOSE,) if tools else ()) + stops, seed=body.seed,
        )  # fmt: skip
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.s.name}
        if body.stream:
            return _sse(self._chat_events(head, prompt, images, params, stops, bool(tools)))
        (out,) = await self._generate(request, [prompt], params, images)
        content, calls, finish = _chat_result(out.text, stops, bool(tools), out.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        if body.logprobs:
            pairs = zip(out.token_ids, out.logprobs, strict=True)
            choice["logprobs"] = {"content": [self._token_logprob(t, lp) for t, lp in pairs]}
        response = head | {"object": "chat.completion", "choices": [choice], "usage": _usage([prompt], [out])}
        if body.return_token_ids:
            choice |= {"token_ids": out.token_ids, "token_versions": out.versions}
            response["prompt_token_ids"] = prompt
        return response

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        _check_unicode(body)
        self._check_rows(body)
        prompts = await _off_loop(self._prompt_ids, body.prompt)
        longest = max(len(p) for p in prompts)
        self._budget(longest, body.max_tokens, "prompt")
        params = SamplingParams(
            max_new_tokens=body.max_tokens or 16, temperature=body.temperature, top_p=body.top_p,
            stop=body.stops, seed=body.seed,
        )  # fmt: skip
        # choice k = prompt k // n, sample k % n; each gets its own seed (engine: seed + k), as in vLLM's n
        rows = [p for p in prompts for _ in range(body.n)]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.s.name}
        if body.stream:
            return _sse(self._completion_events(head, rows, params, body))
        outs = await self._generate(request, rows, params)
        choices = [self._completion_choice(k, p, o, body) for k, (p, o) in enumerate(zip(rows, outs, strict=True))]
        return head | {"object": "text_completion", "choices": choices, "usage": _usage(rows, outs)}

    async def load_weights(self, body: LoadWeightsRequest) -> dict[str, Any]:
        """Read the file, then copy it in between two batches (`between_tokens`: at the next token
        boundary): a 400 names the first bad tensor, and refused weights leave the served ones untouched."""
        if not self.s.allow_weight_updates:
            raise APIError(403, "weight updates are off: start agent-r1 serve with allow_weight_updates=true")
        async with self._loading:
            tensors = await asyncio.to_thread(_read_safetensors, body.path)
            try:
                loaded = await asyncio.to_thread(self.s.engine.load_weights, tensors, body.version, body.between_tokens)
            except ValueError as exc:
                raise APIError(400, f"{body.path}: {exc}", param="path") from None
            return {"loaded": loaded, "version": self.s.engine.weights_version}

    # --- validation ----------------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.s.name:
            raise APIError(
                404, f"The model `{model}` does not exist; this server serves `{self.s.name}`.",
                param="model", code="model_not_found",
            )  # fmt: skip

    def _check_rows(self, body: CompletionRequest) -> None:
        """A 400 for more rows (prompts x n) than one batch holds: a small body could otherwise queue
        millions of rows, which take the memory and hold the engine for hours ahead of everyone."""
        p = body.prompt
        prompts = 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)
        limit = self.s.engine.max_batch_size
        if prompts * body.n > limit:
            raise APIError(
                400, f"{prompts} prompts x n={body.n} is {prompts * body.n} rows; this server decodes at most "
                f"{limit} rows per request (max_batch_size). Send fewer prompts per request.", param="prompt",
            )  # fmt: skip

    def _budget(self, prompt_len: int, requested: int | None, param: str) -> int:
        """max_tokens for a prompt, or a 400 when prompt + requested tokens exceed the context."""
        limit = self.s.engine.max_context
        room = limit - prompt_len
        if room < 1 or (requested is not None and requested > room):
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + (requested or 1)} tokens ({prompt_len} in the prompt, {requested or 1} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param=param, code="context_length_exceeded",
            )  # fmt: skip
        return requested or min(self.s.default_max_tokens, room)

    def _prompt_ids(self, prompt: list[int] | list[list[int]] | str | list[str]) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]  # type: ignore[list-item]
        vocab = len(self.s.tokenizer)
        rows = [self.s.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[union-attr]
        if not rows or any(not r for r in rows):
            raise APIError(400, "prompt must not be empty", param="prompt")
        if any(not 0 <= t < vocab for r in rows for t in r):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return rows

    # --- generation ----------------------------------------------------------------------------------
    def _chat_prompt(self, messages: list[Message]) -> tuple[list[int], list[Image]]:
        """The prompt's ids and its images (read and prepared here: a bad image is a 400 naming it)."""
        fmt, n = self.s.prompt_format, sum(len(image_parts(m)) for m in messages)
        if n and getattr(fmt, "encoder", None) is None:
            raise APIError(400, f"the request has {n} image(s) but {self.s.name} reads text only", param="messages")
        try:
            return fmt.initial(messages), fmt.images(messages)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    async def _generate(
        self, request: Request, prompts: list[list[int]], params: SamplingParams, images: list[Image] = ()
    ) -> list:
        """Whole responses, cancelled when the client disconnects or the deadline passes."""
        extra = {"images": [list(images)]} if images else {}  # one prompt with images (a chat request)
        work = asyncio.ensure_future(self.s.engine.generate(prompts, params, **extra))
        gone = asyncio.ensure_future(_disconnected(request))
        self.generating += 1
        try:
            done, _ = await asyncio.wait({work, gone}, timeout=self.s.request_timeout, return_when="FIRST_COMPLETED")
        finally:
            work.cancel()  # a no-op when it finished; otherwise the engine drops the rows
            gone.cancel()
            self.generating -= 1
        if work in done:
            return work.result()
        if gone in done:  # nobody is listening; the status is for the logs
            raise APIError(499, "client closed the request")
        raise _timeout(self.s.request_timeout)

    @contextlib.asynccontextmanager
    async def _tokens(
        self, prompts: list[list[int]], params: SamplingParams, images: list[Image] = ()
    ) -> AsyncIterator[Any]:
        """(next event, outputs): `await next_event()` gives (row, token, logprob) tuples, then None at
        the end or TimeoutError past the deadline; leaving the block cancels whatever still runs."""
        queue: asyncio.Queue = asyncio.Queue()
        extra = {"images": [list(images)]} if images else {}
        work = asyncio.ensure_future(self.s.engine.generate(prompts, params, lambda *ev: queue.put_nowait(ev), **extra))
        work.add_done_callback(lambda _: queue.put_nowait(None))  # after every token (same loop, FIFO)
        deadline = asyncio.get_running_loop().time() + self.s.request_timeout

        async def next_event() -> tuple[int, int, float] | None:
            try:
                return await asyncio.wait_for(queue.get(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise _timeout(self.s.request_timeout) from None

        self.generating += 1
        try:
            yield next_event, work.result
        finally:
            work.cancel()
            self.generating -= 1

    async def _chat_events(
        self, head: dict, prompt: list[int], images: list[Image], params: SamplingParams, stops: tuple[str, ...],
        tools: bool,
    ) -> AsyncIterator[dict]:  # fmt: skip
        def chunk(delta: dict, finish: str | None = None) -> dict:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return head | {"object": "chat.completion.chunk", "choices": [choice]}

        yield chunk({"role": "assistant", "content": ""})
        text = TextStream(self.s.tokenizer, self.eos_ids, ((CALL_OPEN,) if tools else ()) + stops)
        async with self._tokens([prompt], params, images) as (next_event, outputs):
            while (event := await next_event()) is not None:
                if delta := text.push(event[1]):
                    yield chunk({"content": delta})
            (out,) = outputs()
        content, calls, finish = _chat_result(out.text, stops, tools, out.finish_reason)
        last: dict[str, Any] = {"content": rest} if (rest := text.finish(content or "")) else {}
        if calls:
            last["tool_calls"] = [c | {"index": k} for k, c in enumerate(calls)]
        yield chunk(last, finish)

    async def _completion_events(
        self, head: dict, rows: list[list[int]], params: SamplingParams, body: CompletionRequest
    ) -> AsyncIterator[dict]:
        markers = () if body.include_stop_str_in_output else params.stop
        texts = [TextStream(self.s.tokenizer, self.eos_ids, markers) for _ in rows]

        def chunk(k: int, text: str, finish: str | None = None, **extra: Any) -> dict:
            choice = {"index": k, "text": text, "logprobs": None, "finish_reason": finish} | extra
            return head | {"object": "text_completion", "choices": [choice]}

        async with self._tokens(rows, params) as (next_event, outputs):
            while (event := await next_event()) is not None:
                k, token, logprob = event
                extra: dict[str, Any] = {"token_ids": [token]} if body.return_token_ids else {}
                if body.logprobs is not None:
                    extra["logprobs"] = self._completion_logprobs([token], [logprob], body)
                yield chunk(k, texts[k].push(token), **extra)
            for k, out in enumerate(outputs()):
                finish, stop_reason = _finish(out, params.stop)
                yield chunk(k, texts[k].finish(), finish, stop_reason=stop_reason)

    # --- responses -----------------------------------------------------------------------------------
    def _completion_choice(self, k: int, prompt: list[int], out: GenerateOutput, body: CompletionRequest) -> dict:
        finish, stop_reason = _finish(out, body.stops)
        text = out.text if body.include_stop_str_in_output else visible_prefix(out.text, body.stops, final=True)
        choice: dict[str, Any] = {"index": k, "text": text, "logprobs": None}
        choice |= {"finish_reason": finish, "stop_reason": stop_reason}
        if body.logprobs is not None:
            choice["logprobs"] = self._completion_logprobs(out.token_ids, out.logprobs, body)
        if body.return_token_ids:
            choice |= {"prompt_token_ids": prompt, "token_ids": out.token_ids, "token_versions": out.versions}
        return choice

    def _completion_logprobs(self, ids: list[int], logprobs: list[float], body: CompletionRequest) -> dict:
        """OpenAI's legacy logprobs object; top alternatives are not computed (`top_logprobs` is null)."""
        tokens = [f"token_id:{t}" if body.return_tokens_as_token_ids else self.s.tokenizer.decode([t]) for t in ids]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None}

    def _token_logprob(self, token: int, logprob: float) -> dict:
        return {"token": self.s.tokenizer.decode([token]), "logprob": logprob, "bytes": None, "top_logprobs": []}


def _template_messages(messages: list[ChatMessage], tools: list[dict]) -> list[Message]:
    """OpenAI messages -> the messages `ToolEnv` would have built: one system prompt listing the tools,
    assistant calls as hermes `<tool_call>` blocks, and consecutive tool results as one user turn."""
    out: list[Message] = []
    system: list[str] = []
    results: list[str] = []
    shown: list[list[str]] = []  # per tool result, its images
    for i, m in enumerate(messages):
        if results and m.role != "tool":
            out.append({"role": "user", "content": format_tool_responses(results, shown)})
            results, shown = [], []
        text = _text(m, i, images=m.role in ("user", "tool"))
        if m.role == "tool":
            results.append(text)
            shown.append(_images(m))
        elif m.role in ("system", "developer") and tools:
            system.append(text)  # becomes the instructions of the tools system prompt
        elif m.role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        elif m.role == "assistant":
            calls = [format_tool_call(c.function.name, _arguments(c.function.arguments, i)) for c in m.tool_calls or []]
            out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + calls)})
        else:
            images = [{"type": "image", "image": url} for url in _images(m)]
            out.append({"role": "user", "content": [*images, {"type": "text", "text": text}] if images else text})
    if results:
        out.append({"role": "user", "content": format_tool_responses(results, shown)})
    if tools:
        out.insert(0, {"role": "system", "content": tools_system_prompt(tools, "\n\n".join(system))})
    return out


def _text(m: ChatMessage, i: int, images: bool = False) -> str:
    """The text of a message; `images`: its image_url parts are allowed (user and tool messages), and
    each must be a data URL (a server that fetched URLs would reach wherever a client points it)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    allowed = ("text", "image_url") if images else ("text",)
    if any(part.get("type") not in allowed for part in m.content):
        what = "text and image_url" if images else "text"
        raise APIError(400, f"only {what} content parts are supported here", param=f"messages[{i}].content")
    if any(not str(url).startswith("data:") for url in _images(m)):
        raise APIError(400, "an image_url must be a data: URL (base64)", param=f"messages[{i}].content")
    return "".join(str(part.get("text", "")) for part in m.content if part.get("type") == "text")


def _images(m: ChatMessage) -> list[str]:
    """The image URLs of a message's image_url parts, in order (images go before its text)."""
    if not isinstance(m.content, list):
        return []
    return [str(url.get("url") if isinstance(url, dict) else url) for p in m.content if (url := p.get("image_url"))]


def _arguments(arguments: str, i: int) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, a number of more than 4300 digits, nesting too deep
        raise APIError(400, "tool call arguments must be a JSON string", param=f"messages[{i}].tool_calls") from None


def _tool_schemas(specs: list[ToolSpec]) -> list[dict]:
    """Validate client tools like our own: a valid name and an object JSON schema (they run client-side)."""
    schemas = []
    for i, spec in enumerate(specs):
        f = spec.function
        try:
            if f.parameters.get("type") != "object":
                raise ValueError('parameters must be a JSON schema with "type": "object"')
            schemas.append(Tool(f.name, f.description, f.parameters, fn=_runs_on_client).schema)
        except (ValueError, TypeError, jsonschema.SchemaError) as exc:  # TypeError: `$schema` is not a string
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise APIError(400, f"invalid tool {f.name!r}: {message}", param=f"tools[{i}]") from None
    return schemas


def _runs_on_client(**_: Any) -> None:
    raise RuntimeError("tools given in a request are called by the client, never by the server")


def _chat_result(text: str, stops: tuple[str, ...], tools: bool, finish: str) -> tuple[str | None, list, str]:
    """(content, OpenAI tool_calls, finish_reason) of one response; a malformed call stays content."""
    calls = [c for c in parse_tool_calls(text) if isinstance(c, ParsedCall)] if tools else []
    if not calls:
        return visible_prefix(text, stops, final=True), [], "length" if finish == "length" else "stop"
    openai_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c.name,
                "arguments": c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments),
            },
        }
        for c in calls
    ]
    content = visible_prefix(text, (CALL_OPEN, *stops), final=True)
    return (content if content.strip() else None), openai_calls, "tool_calls"


def _finish(out: GenerateOutput, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """vLLM's (finish_reason, stop_reason): EOS is ("stop", None), a stop string ("stop", that string)."""
    if out.finish_reason == "length":
        return "length", None
    if out.finish_reason == "stop":
        found = [(out.text.find(s), s) for s in stops if s in out.text]
        return "stop", min(found)[1] if found else None
    return "stop", None


def _read_safetensors(path: str) -> dict:
    """The tensors of a safetensors file, or a 400 saying why not."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise APIError(400, f"no weights file at {path!r}", param="path")
    try:
        return load_file(path)
    except Exception as exc:  # not safetensors, truncated, unreadable
        message = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise APIError(400, f"cannot read {path!r} as safetensors: {message}", param="path") from None


def _usage(prompts: list[list[int]], outs: list[GenerateOutput]) -> dict[str, int]:
    p, c = sum(map(len, prompts)), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _timeout(seconds: float) -> APIError:
    return APIError(504, f"request timed out after {seconds:g}s", type="timeout_error", code="timeout")


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 list of problems -> one OpenAI-style 400 naming the first one."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}")
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    if not loc:
        return APIError(400, "request body must be a JSON object")
    return APIError(400, f"{loc}: {first.get('msg', 'invalid value')}", param=loc)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body is already read, so only a disconnect arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _server_error(exc: Exception) -> APIError:
    return APIError(500, f"{type(exc).__name__}: {exc}"[:500], type="server_error")


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: one `data: {json}` per event, an error event if generation fails or times
    out midway (the status line is already sent), then `data: [DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        except Exception as exc:  # the engine failed mid-stream: tell this client, keep serving the rest
            yield f"data: {json.dumps(_server_error(exc).body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


_TOKENIZE = ThreadPoolExecutor(max_workers=2, thread_name_prefix="agent-r1-tokenize")


async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run fn (rendering and tokenizing a prompt) in a thread: a prompt of megabytes takes seconds, and
    on the event loop it would freeze every stream and health check meanwhile. The pool is its own, so
    it never takes the threads the engine decodes in."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE, fn, *args)


def _check_unicode(body: Any) -> None:
    """A 400 naming the first string that is not Unicode text: JSON's `\\ud800` escape gives a lone
    surrogate, which the tokenizer refuses with a TypeError (a 500) and UTF-8 cannot encode."""
    stack: list[tuple[str, Any]] = [("", body.model_dump())]
    while stack:  # iterative: content parts may nest deeper than the recursion limit
        path, value = stack.pop()
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise APIError(
                    400, f"{path}: text is not valid Unicode (a lone surrogate at character {exc.start})", param=path
                ) from None
        elif isinstance(value, dict):
            stack += [(f"{path}.{k}".lstrip("."), v) for k, v in value.items()]
            stack += [(path, k) for k in value if isinstance(k, str)]  # keys reach the prompt too (tool schemas)
        elif isinstance(value, list):
            stack += [(f"{path}.{i}", v) for i, v in enumerate(value) if isinstance(v, str | dict | list)]


class _BodyLimit:
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
            return await _error_response(self._too_large(f"{int(length)} bytes"))(scope, receive, send)
        seen = 0

        async def counted() -> ASGIMessage:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge(self._too_large(f"more than {self.limit} bytes"))
            return message

        await self.app(scope, counted, send)

    def _too_large(self, size: str) -> APIError:
        return APIError(
            413, f"the request body ({size}) is over this server's limit of {self.limit} bytes (max_request_mb)",
            code="request_too_large",
        )  # fmt: skip


class _TooLarge(HTTPException):
    """Raised while the body is read: FastAPI turns any other exception there into a generic 400, but
    lets an HTTPException through to the handler, which answers with `error`."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error
