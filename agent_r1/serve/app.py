"""`create_app`: an OpenAI-compatible HTTP API over an engine (`make_engine`), which makes it a rollout engine too.

* `/v1/chat/completions` renders messages with the model's prompt format and the same hermes tools
  system prompt `ToolEnv` trains with, stops at `</tool_call>` as training rollouts do, and returns the
  calls as OpenAI `tool_calls` (with `parallel_tool_calls: true`, the model ends its turn itself, every
  call it wrote returned). `tool_choice` `required` or a named function writes the call's opening at the
  end of the prompt and the model samples the rest (`messages.forced_call`); `n` samples that many
  answers, each with its own seed; a forced call and `response_format` JSON are sampled under a grammar
  (`messages.answer_grammar`). `stream=true` sends server-sent events.
* `/v1/messages` (Anthropic Messages, with `/v1/messages/count_tokens`) and `/v1/responses` (OpenAI
  Responses, with `previous_response_id` over the responses this server stored) are the chat request they
  mean (agent_r1/api/anthropic.py, responses.py), answered in their own bodies and event streams.
* With a recorder (`serve --learn`, agent_r1/online/record.py), every chat request is committed to the
  interaction store before its answer goes out; `/v1/feedback` takes users' scores and `/v1/learn` says
  what the store holds (docs/online.md).
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
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import SQLAlchemyError
from transformers import PreTrainedTokenizerBase

from agent_r1.api import anthropic, bodies, responses
from agent_r1.api.http import install_error_handlers, off_loop, sse
from agent_r1.api.messages import (
    answer_grammar,
    chat_result,
    check_unicode,
    forced_call,
    template_messages,
    tool_schemas,
)
from agent_r1.api.schema import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, LoadWeightsRequest
from agent_r1.engines.protocol import Engine, GenerateOutput, SamplingParams
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.models.grammar import check_grammar, json_schema_grammar
from agent_r1.models.vision import image_parts
from agent_r1.online.record import INTERACTION_HEADER, SESSION_HEADER, Recorder
from agent_r1.rollout.text_stream import TextStream, visible_prefix
from agent_r1.types import Image, Message


@dataclass
class ServedModel:
    """Everything the API needs to know about the one model it serves."""

    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    prompt_format: PromptFormat
    name: str  # the id clients put in "model"
    eos_ids: Collection[int]  # the tokens that end a response: sampled, never shown
    request_timeout: float = 300.0  # seconds before a request is cancelled and answered with a 504
    default_max_tokens: int = 512  # chat completions without max_tokens get at most this many
    allow_weight_updates: bool = False  # /v1/load_weights replaces the model: only for a trainer's own server
    max_request_bytes: int = 8 * 2**20  # a larger body is a 413, refused before it is held in memory
    max_batch_size: int = 64  # rows one request may ask for (prompts x n): the engine's batch
    recorder: Recorder | None = None  # `serve --learn`: every chat request is committed to the store before its answer
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(served: ServedModel) -> FastAPI:
    """The FastAPI app; run it with uvicorn (`agent-r1 serve`) or call it in-process in tests."""
    api = _API(served)
    app = FastAPI(title="agent-r1", summary="OpenAI-compatible API and rollout engine")
    install_error_handlers(app, served.max_request_bytes)

    app.get("/health")(lambda: {"status": "ok", "generating": api.generating})
    app.get("/v1/models")(api.models)
    app.post("/v1/chat/completions")(api.chat)
    app.post("/v1/messages")(api.messages)
    app.post("/v1/messages/count_tokens")(api.count_tokens)
    app.post("/v1/responses")(api.responses)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/load_weights")(api.load_weights)
    if served.recorder is not None:
        app.post("/v1/feedback")(api.feedback)
        app.get("/v1/learn")(api.learn_status)
    return app


class Feedback(BaseModel):
    """`/v1/feedback`: a user's score of one served answer (the id in its body, or the `x-agent-r1-interaction`
    header) or of a whole session."""

    model_config = ConfigDict(extra="forbid")

    response_id: str | None = Field(None, max_length=128)
    session_id: str | None = Field(None, max_length=128)
    score: float = Field(ge=0, le=1, allow_inf_nan=False)  # 0 = bad, 1 = good
    comment: str = Field("", max_length=4000)


class _API:
    def __init__(self, served: ServedModel) -> None:
        self.s = served
        self.eos_ids = set(served.eos_ids)
        self._loading = asyncio.Lock()  # one weight load at a time: one extra copy of the weights in memory
        self.generating = 0  # requests queued or decoding; /health shows it, so a leaked one is visible
        self.stored = responses.ResponseStore()  # what a Responses request's previous_response_id refers to

    # --- endpoints -----------------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        s = self.s
        extra = {"max_model_len": s.engine.max_context, "weights_version": s.engine.weights_version}
        return bodies.model_list({"id": s.name, "created": s.created} | extra)

    async def chat(self, body: ChatCompletionRequest, request: Request, response: Response) -> Any:
        _, result = await self._chat(body, request)
        return _tagged(request, response, sse(result) if body.stream else result)

    async def messages(self, body: anthropic.MessagesRequest, request: Request, response: Response) -> Any:
        """Anthropic Messages: the chat request it means, answered as a Message or Anthropic's event stream."""
        chat = anthropic.to_chat(body, ChatCompletionRequest)
        message_id = None if body.stream else anthropic.new_id()  # the id feedback names (a stream's: the header)
        prompt_tokens, result = await self._chat(chat, request, message_id)
        if body.stream:
            return _tagged(request, response, sse(anthropic.events(result, self.s.name, prompt_tokens), "messages"))
        return _tagged(request, response, anthropic.message(result) | ({"id": message_id} if message_id else {}))

    async def count_tokens(self, body: anthropic.CountTokensRequest) -> dict[str, int]:
        """The prompt's length in tokens, rendered as /v1/messages would render it."""
        prompt, *_ = await self._chat_input(anthropic.to_chat(body, ChatCompletionRequest))
        return {"input_tokens": len(prompt)}

    async def responses(self, body: responses.ResponsesRequest, request: Request, response: Response) -> Any:
        """OpenAI Responses: the chat request that the stored conversation + the input items mean; the answer
        is stored (`store`) for a later `previous_response_id`."""
        history = self.stored.history(body.previous_response_id)
        chat = responses.to_chat(body, history, ChatCompletionRequest, self.s.name)
        response_id = responses.new_id()

        def keep(output: list[dict[str, Any]]) -> None:
            if body.store:
                self.stored.put(response_id, [*history, *responses.input_items(body), *output])

        _, result = await self._chat(chat, request, response_id)
        if body.stream:
            events = responses.events(result, body, response_id, self.s.name, keep)
            return _tagged(request, response, sse(events, "responses"))
        answer = responses.from_completion(body, response_id, result)
        keep(answer["output"])
        return _tagged(request, response, answer)

    async def _chat(
        self, body: ChatCompletionRequest, request: Request, answer_id: str | None = None
    ) -> tuple[int, Any]:
        """(prompt tokens, the chat.completion or, streaming, its chunks) of a chat request; with a recorder,
        committed to the store (as `answer_id`, default the completion's id) before the answer goes out."""
        self._check_model(body.model)
        self._check_chat(body)
        prompt, images, tools, forced = await self._chat_input(body)
        calls_format = self.s.prompt_format.tool_format
        special = tuple(self.s.tokenizer.all_special_tokens)
        grammar = await off_loop(answer_grammar, body, tools, calls_format, special)
        stops = body.stops + tuple(self.s.prompt_format.stop)
        max_tokens = self._budget(len(prompt), body.max_completion_tokens or body.max_tokens, "messages")
        one_call = tools and not body.parallel_tool_calls
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            stop=(calls_format.stop if one_call else ()) + stops, seed=body.seed, grammar=grammar,
        )  # fmt: skip
        head = bodies.head("chat", self.s.name)
        rec = self.s.recorder
        n = rec.explores(body.n, body.stream) if rec else body.n  # exploration samples more than it serves
        rows = [prompt] * n  # choice k is sampled with seed + k (the engine's), as vLLM's n
        record = None
        if rec:
            exact = body.top_p >= 1 and not images  # log-probs of the whole distribution, a prompt of ids alone
            record = await self._recording(body, request, prompt, grammar, answer_id or head["id"], n, exact)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return len(prompt), self._chat_events(head, rows, images, params, stops, tools, forced, usage, record)
        outs = await self._generate(request, rows, params, images)
        choices, answers = [], []
        for k, out in enumerate(outs):
            content, calls, finish = chat_result(forced + out.text, stops, tools, out.finish_reason, calls_format)
            answers.append(bodies.chat_message(content, calls))
            logprobs = bodies.token_logprobs(self.s.tokenizer, out.token_ids, out.logprobs) if body.logprobs else None
            choice = bodies.chat_choice(k, answers[-1], finish, logprobs)
            if body.return_token_ids:
                choice |= {"token_ids": out.token_ids, "token_versions": out.versions}
            choices.append(choice)
        if record:
            await record(outs, answers)
        choices, outs = choices[: body.n], outs[: body.n]  # the explored answers are stored, not sent
        response = bodies.chat_completion(head, choices, *_usage(rows[: body.n], outs))
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt
        return len(prompt), response

    async def _recording(
        self, body: ChatCompletionRequest, request: Request, prompt: list[int], grammar: str | None, answer_id: str,
        n: int, exact: bool,
    ) -> Callable[[list[GenerateOutput], list[dict[str, Any]]], Awaitable[None]]:  # fmt: skip
        """Find the request's session now, and return the coroutine that commits its `n` answers (agent_r1/online/
        record.py). A store that fails is a 503: no answer goes out that the store does not hold."""
        rec = self.s.recorder
        assert rec is not None
        request.state.interaction = answer_id
        messages, changed = await off_loop(rec.redacted, [m.model_dump(exclude_none=True) for m in body.messages])
        stored = prompt
        if changed:  # the prompt the trainer sees is the redacted conversation, rendered the same way
            redacted = body.model_copy(update={"messages": [ChatMessage(**m) for m in messages]})
            stored = (await self._chat_input(redacted))[0]
        try:
            place = await asyncio.to_thread(rec.place, request.headers, body.user, messages)
        except STORE_ERRORS as exc:
            raise _store_down(exc) from None
        request.state.session = place.session
        ids = [answer_id] + [f"{answer_id}-{k}" for k in range(1, n)]

        async def record(outs: list[GenerateOutput], answers: list[dict[str, Any]]) -> None:
            try:
                args = (place, answer_id, ids, messages, stored, outs, answers, grammar, body.temperature, exact)
                await asyncio.to_thread(rec.record, *args)
            except STORE_ERRORS as exc:
                raise _store_down(exc) from None

        return record

    async def feedback(self, body: Feedback) -> dict[str, Any]:
        """A user's score of a served answer or a session, stored as an explicit reward; a 404 names an id the
        store does not hold."""
        assert self.s.recorder is not None
        store = self.s.recorder.store
        if (body.response_id is None) == (body.session_id is None):
            raise APIError(400, "feedback needs response_id or session_id (one of them)")
        kind, key = ("interaction", body.response_id) if body.response_id else ("session", body.session_id)
        what = "response_id" if kind == "interaction" else "session_id"
        detail = {"comment": body.comment} if body.comment else {}
        try:
            if not await asyncio.to_thread(store.exists, **{kind: key}):
                raise APIError(404, f"{what} {key!r} is not in the interaction store", param=what)
            await asyncio.to_thread(store.add_reward, "explicit", body.score, **{kind: key}, detail=detail)
        except STORE_ERRORS as exc:
            raise _store_down(exc) from None
        return {"recorded": True, what: key, "score": body.score}

    async def learn_status(self) -> dict[str, Any]:
        """What the store holds and how far training has got: interactions, rewards by source, versions."""
        assert self.s.recorder is not None
        try:
            counts = await asyncio.to_thread(self.s.recorder.store.counts)
        except STORE_ERRORS as exc:
            raise _store_down(exc) from None
        return counts | {"recorded_here": self.s.recorder.recorded, "weights_version": self.s.engine.weights_version}

    async def _chat_input(self, body: ChatCompletionRequest) -> tuple[list[int], list[Image], list[dict], str]:
        """(prompt ids, images, tools, forced opening) of a chat request; a 400 names what is wrong in it."""
        check_unicode(body)
        tools = tool_schemas(body.tools) if body.tools and body.tool_choice != "none" else []
        forced = forced_call(body.tool_choice, tools, self.s.prompt_format.tool_format)  # it ends the prompt
        messages = template_messages(body.messages, tools, self.s.prompt_format)
        prompt, images = await off_loop(self._chat_prompt, messages, tools)
        prompt = prompt + (self.s.tokenizer.encode(forced, add_special_tokens=False) if forced else [])
        return prompt, images, tools, forced

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        self._check_model(body.model)
        check_unicode(body)
        self._check_rows(body)
        prompts = await off_loop(self._prompt_ids, body.prompt)
        longest = max(len(p) for p in prompts)
        self._budget(longest, body.max_tokens, "prompt")
        params = SamplingParams(
            max_new_tokens=body.max_tokens or 16, temperature=body.temperature, top_p=body.top_p,
            stop=body.stops, seed=body.seed, grammar=await off_loop(self._grammar, body.structured_outputs),
        )  # fmt: skip
        # choice k = prompt k // n, sample k % n; each gets its own seed (engine: seed + k), as in vLLM's n
        rows = [p for p in prompts for _ in range(body.n)]
        head = bodies.head("text", self.s.name)
        if body.stream:
            return sse(self._completion_events(head, rows, params, body))
        outs = await self._generate(request, rows, params)
        choices = [self._completion_choice(k, p, o, body) for k, (p, o) in enumerate(zip(rows, outs, strict=True))]
        return head | {"object": "text_completion", "choices": choices, "usage": bodies.usage(*_usage(rows, outs))}

    def _grammar(self, structured: dict[str, Any] | None) -> str | None:
        """The grammar of vLLM's `structured_outputs` ({"grammar": EBNF} or {"json": schema}), checked by
        compiling it: a 400 names what is wrong."""
        if not structured:
            return None
        try:
            if set(structured) == {"grammar"} and isinstance(structured["grammar"], str):
                grammar = structured["grammar"]
            elif set(structured) == {"json"}:
                schema = structured["json"]
                grammar = json_schema_grammar(json.loads(schema) if isinstance(schema, str) else schema)
            else:
                raise ValueError('give {"grammar": EBNF text} or {"json": a JSON schema}')
            check_grammar(grammar)
        except ValueError as exc:
            raise APIError(400, f"structured_outputs: {exc}", param="structured_outputs") from None
        return grammar

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

    def _check_chat(self, body: ChatCompletionRequest) -> None:
        """A 400 for more answers than this server decodes at once."""
        limit = self.s.max_batch_size
        if body.n > limit:
            raise APIError(
                400, f"n={body.n} is more answers than this server decodes at once ({limit}, max_batch_size)",
                param="n",
            )  # fmt: skip

    def _check_rows(self, body: CompletionRequest) -> None:
        """A 400 for more rows (prompts x n) than one batch holds: a small body could otherwise queue
        millions of rows, which take the memory and hold the engine for hours ahead of everyone."""
        p = body.prompt
        prompts = 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)
        limit = self.s.max_batch_size
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
    def _chat_prompt(self, messages: list[Message], tools: list[dict]) -> tuple[list[int], list[Image]]:
        """The prompt's ids and its images (read and prepared here: a bad image is a 400 naming it). A
        template that renders tools itself is given them."""
        fmt, n = self.s.prompt_format, sum(len(image_parts(m)) for m in messages)
        fmt = fmt.with_tools(tools) if fmt.native_tools and tools else fmt
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
        extra = {"images": [list(images)] * len(prompts)} if images else {}  # a chat request's prompt, n times
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
        extra = {"images": [list(images)] * len(prompts)} if images else {}
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
        self, head: dict, rows: list[list[int]], images: list[Image], params: SamplingParams,
        stops: tuple[str, ...], tools: list[dict], forced: str, include_usage: bool, record: Any = None,
    ) -> AsyncIterator[dict]:  # fmt: skip
        """Each choice's content as it is sampled (none inside a call, nor after a forced call's opening),
        then its tool calls, whole, with its finish reason; with `include_usage`, a last chunk with the usage.
        `record` commits the answers before the last chunks go out."""

        for k in range(len(rows)):
            yield bodies.chat_chunk(head, k, {"role": "assistant", "content": ""})
        calls_format = self.s.prompt_format.tool_format
        markers = (calls_format.markers if tools else ()) + stops
        texts = [TextStream(self.s.tokenizer, self.eos_ids, markers) for _ in rows]
        async with self._tokens(rows, params, images) as (next_event, outputs):
            while (event := await next_event()) is not None:
                if not forced and (delta := texts[event[0]].push(event[1])):
                    yield bodies.chat_chunk(head, event[0], {"content": delta})
            outs = outputs()
        results = [chat_result(forced + o.text, stops, tools, o.finish_reason, calls_format) for o in outs]
        if record:
            await record(outs, [bodies.chat_message(content, calls) for content, calls, _ in results])
        for k, (content, calls, finish) in enumerate(results):
            yield bodies.chat_chunk(head, k, bodies.last_delta(texts[k].finish(content or ""), calls), finish)
        if include_usage:
            yield head | {"object": "chat.completion.chunk", "choices": [], "usage": bodies.usage(*_usage(rows, outs))}

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


def _tagged(request: Request, response: Response, result: Any) -> Any:
    """The answer with the served interaction's id and its session's in headers (`serve --learn`), for
    /v1/feedback."""
    interaction = getattr(request.state, "interaction", None)
    if interaction is not None:
        headers = (result if isinstance(result, Response) else response).headers
        headers[INTERACTION_HEADER], headers[SESSION_HEADER] = interaction, request.state.session
    return result


STORE_ERRORS = (SQLAlchemyError, OSError)  # the store failed; anything else is a bug, a 500 that says so


def _store_down(exc: BaseException) -> APIError:
    message = (str(exc).splitlines() or [type(exc).__name__])[0]
    return APIError(503, f"the interaction store is unavailable: {message}", type="server_error", code="store_down")


def _usage(prompts: list[list[int]], outs: list[GenerateOutput]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a request's rows."""
    return sum(map(len, prompts)), sum(len(o.token_ids) for o in outs)


def _timeout(seconds: float) -> APIError:
    return APIError(504, f"request timed out after {seconds:g}s", type="timeout_error", code="timeout")


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body is already read, so only a disconnect arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
