"""Chaos for `agent-r1 serve`: a storm of good and bad clients at once, then check the server is whole.

The script starts `agent-r1 serve` as a subprocess on a free 127.0.0.1 port (a tiny random Llama over
SmolLM2's real tokenizer unless `--model` names a directory, so the model costs nothing and the
server's own handling is what is measured). It sends one warm-up request, then `--clients` requests
at once. A share of them (`--bad-fraction`) are bad, cycling through every bad kind:

* malformed: invalid JSON, a body that is not an object, wrong types, a missing field, an unknown
  role, text with a lone surrogate, a seed outside the 64-bit range;
* oversized: a body of many MB (with a Content-Length, and chunked without one), a prompt over the
  context window, a huge `max_tokens`, more prompt rows than one batch holds;
* early disconnects, over raw sockets: mid-upload, while a whole response is being generated, and
  mid-stream, for streamed chat and streamed completions.

The rest are good: chat, streamed chat, chat with the calculator tool, token-id completions. The
properties checked (`problems` lists each one broken) are:

* every good client gets a valid 200 completion: no 5xx and no connection error;
* every bad client gets the 4xx its kind calls for, with an OpenAI-style error body; a client that
  disconnects gets no 5xx before it goes;
* the server stays up: its process is alive, `/health` and `/v1/models` answer, no request is left
  generating for nobody (`/health` counts them), a further batch of good requests completes, the
  server's memory did not balloon, and its log holds no traceback.

    python benchmarks/chaos_serve.py --clients 100 --bad-fraction 0.2 --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

GOOD_KINDS = ("chat", "chat_stream", "chat_tools", "completion")
# each bad kind -> the status it must get (None: the client disconnects before any answer can matter)
BAD_KINDS: dict[str, int | None] = {
    "invalid_json": 400,
    "not_object": 400,
    "wrong_types": 400,
    "missing_field": 400,
    "unknown_role": 400,
    "lone_surrogate": 400,
    "seed_overflow": 400,
    "huge_body": 413,
    "huge_chunked_body": 413,
    "long_prompt": 400,
    "huge_max_tokens": 400,
    "too_many_rows": 400,
    "drop_mid_upload": None,
    "drop_while_generating": None,
    "drop_mid_stream": None,
    "drop_mid_completion_stream": None,
}
CONTEXT_KINDS = ("long_prompt", "huge_max_tokens")  # their 400 must name the context window
REQUEST_TIMEOUT_S = 120.0  # a client that waits longer reports a hung server
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@dataclass
class Outcome:
    """What one client saw. `ok` says whether it got what its kind calls for."""

    kind: str
    group: str  # "good" or "bad"
    status: int | str  # the HTTP status, or "closed" (a disconnect) / "error" (a connection error)
    ok: bool
    seconds: float
    why: str = ""  # what was wrong, when not ok


# --- the server -------------------------------------------------------------------------------------


def build_tiny_model(out: Path) -> Path:
    """A 2-layer random Llama (hidden 32) over SmolLM2's real tokenizer, saved as a Hugging Face
    directory: real tokenization and chat template, with a forward pass that costs next to nothing,
    so the storm measures the server and not the model."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from agent_r1.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@dataclass
class Server:
    """A running `agent-r1 serve` subprocess; its stderr goes to a file that is read at the end."""

    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float:
        """Resident memory of the server process, from /proc (Linux), in MiB; -1 where unreadable."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return -1.0

    def tracebacks(self) -> int:
        """Tracebacks in the server's log: an exception that escaped a handler is a bug even when the
        client saw a 4xx."""
        return self.log.read_text(errors="replace").count("Traceback (most recent call last)")


def start_server(model: str | Path, options: list[str], log_dir: Path) -> Server:
    """`agent-r1 serve model=... port=0` on loopback; waits for the line that names its address."""
    cmd = [sys.executable, "-m", "agent_r1.cli", "serve", f"model={model}", "port=0", "log_level=warning", *options]
    log = log_dir / "server.log"
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("agent-r1 serve:"):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}\n{log.read_text()[-2000:]}")
    return Server(proc, line.split(" at ")[1].strip().removesuffix("/v1"), log)


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


# --- requests -----------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """What every client needs to build its request."""

    url: str
    model: str
    max_model_len: int
    max_tokens: int
    max_request_bytes: int
    rng: random.Random

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)


def chat_body(ctx: Ctx, **extra: Any) -> dict:
    """A small chat request; extra fields override the defaults."""
    a, b = ctx.rng.randint(2, 99), ctx.rng.randint(2, 99)
    body = {
        "model": ctx.model,
        "messages": [{"role": "user", "content": f"What is {a} * {b}?"}],
        "max_tokens": ctx.max_tokens,
        "temperature": 0,
    }
    return body | extra


def prompt_ids(ctx: Ctx, n: int = 12) -> list[int]:
    return [ctx.rng.randint(100, 40_000) for _ in range(n)]


def check_chat(r: httpx.Response, ctx: Ctx) -> str:
    """Why a chat response is not a valid completion ("" when it is)."""
    data = r.json()
    choice = data["choices"][0]
    if data.get("object") != "chat.completion" or choice["message"]["role"] != "assistant":
        return f"not a chat completion: {r.text[:200]}"
    if choice["finish_reason"] not in ("stop", "length", "tool_calls"):
        return f"finish_reason {choice['finish_reason']!r}"
    if not 1 <= data["usage"]["completion_tokens"] <= ctx.max_tokens:
        return f"completion_tokens {data['usage']['completion_tokens']} outside [1, {ctx.max_tokens}]"
    return ""


def check_stream(r: httpx.Response, ctx: Ctx) -> str:
    """Why a streamed chat is not a valid completion: every event a chunk, a finish, then [DONE]."""
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    if not lines or lines[-1] != "[DONE]":
        return f"stream does not end with [DONE]: {r.text[-200:]}"
    events = [json.loads(line) for line in lines[:-1]]
    if bad := [e for e in events if e.get("object") != "chat.completion.chunk"]:
        return f"not a chunk: {json.dumps(bad[0])[:200]}"
    if events[-1]["choices"][0]["finish_reason"] not in ("stop", "length", "tool_calls"):
        return f"last chunk has finish_reason {events[-1]['choices'][0]['finish_reason']!r}"
    return ""


def check_completion(r: httpx.Response, ctx: Ctx) -> str:
    """Why a token-id completion is not valid: its token ids and log-probs, one per sampled token."""
    choice = r.json()["choices"][0]
    ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    if not 1 <= len(ids) <= ctx.max_tokens or len(logprobs) != len(ids):
        return f"{len(ids)} token ids, {len(logprobs)} log-probs (max_tokens {ctx.max_tokens})"
    if choice["finish_reason"] not in ("stop", "length"):
        return f"finish_reason {choice['finish_reason']!r}"
    return ""


async def good(kind: str, client: httpx.AsyncClient, ctx: Ctx) -> Outcome:
    """One good client: a request of its kind, then a check that the answer is a valid completion."""
    if kind == "completion":
        path, check = "/v1/completions", check_completion
        body = {"model": ctx.model, "prompt": prompt_ids(ctx), "max_tokens": ctx.max_tokens, "temperature": 1.0}
        body |= {"seed": ctx.rng.randint(0, 2**31), "logprobs": 0, "return_token_ids": True}
    else:
        path, check = "/v1/chat/completions", check_stream if kind == "chat_stream" else check_chat
        body = chat_body(ctx, stream=kind == "chat_stream", **({"tools": [CALCULATOR]} if kind == "chat_tools" else {}))
    t0 = time.perf_counter()
    try:
        r = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        return Outcome(kind, "good", "error", False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return Outcome(kind, "good", r.status_code, False, seconds, r.text[:300])
    try:
        why = check(r, ctx)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        why = f"unreadable response ({type(exc).__name__}: {exc}): {r.text[:200]}"
    return Outcome(kind, "good", 200, not why, seconds, why)


# --- bad clients ----------------------------------------------------------------------------------------


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


def malformed_body(kind: str, ctx: Ctx) -> tuple[str, bytes]:
    """(path, body) of a malformed or oversized request sent whole with a Content-Length."""
    chat = "/v1/chat/completions"
    if kind == "invalid_json":
        return chat, _json(chat_body(ctx))[:-7]  # cut off mid-object
    if kind == "not_object":
        return chat, _json([chat_body(ctx)])
    if kind == "wrong_types":
        return chat, _json(chat_body(ctx, messages="What is 2 * 3?", max_tokens="ten"))
    if kind == "missing_field":
        return chat, _json({k: v for k, v in chat_body(ctx).items() if k != "messages"})
    if kind == "unknown_role":
        return chat, _json(chat_body(ctx, messages=[{"role": "wizard", "content": "What is 2 * 3?"}]))
    if kind == "lone_surrogate":  # valid JSON (an escaped UTF-16 half), but no Unicode text
        return chat, _json(chat_body(ctx, messages=[{"role": "user", "content": "What is \ud800 * 3?"}]))
    if kind == "seed_overflow":  # the good clients' sampling settings, so it may share their batch
        return chat, _json(chat_body(ctx, seed=2**64 + ctx.rng.randint(0, 99)))
    if kind == "huge_body":  # valid JSON of 8 times the size limit
        text = "word " * (8 * ctx.max_request_bytes // 5)
        return chat, _json(chat_body(ctx, messages=[{"role": "user", "content": text}]))
    if kind == "long_prompt":  # over the context window, though well under the body limit
        return chat, _json(chat_body(ctx, messages=[{"role": "user", "content": "word " * (2 * ctx.max_model_len)}]))
    if kind == "huge_max_tokens":
        return chat, _json(chat_body(ctx, max_tokens=10**12))
    if kind == "too_many_rows":  # a small body that would queue 50,000 x 64 rows
        body = {"model": ctx.model, "prompt": [[7]] * 50_000, "n": 64, "max_tokens": 1}
        return "/v1/completions", _json(body)
    raise ValueError(kind)


async def chunks(data: bytes, size: int = 1 << 16) -> AsyncIterator[bytes]:
    """A body with no Content-Length: httpx sends it chunked, so only counting can limit it."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def bad(kind: str, ctx: Ctx) -> Outcome:
    """One bad client with its own connection; ok when it got the 4xx its kind calls for."""
    if kind.startswith("drop_"):
        return await drop(kind, ctx)
    want = BAD_KINDS[kind]
    path, body = malformed_body("huge_body" if kind == "huge_chunked_body" else kind, ctx)
    content: Any = chunks(body) if kind == "huge_chunked_body" else body
    t0 = time.perf_counter()
    try:
        async with httpx.AsyncClient(base_url=ctx.url, timeout=REQUEST_TIMEOUT_S) as client:
            r = await client.post(path, content=content, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        return Outcome(kind, "bad", "error", False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - t0
    why = "" if r.status_code == want else f"wanted {want}: {r.text[:300]}"
    if not why:
        why = _error_body_problem(r, kind, ctx)
    return Outcome(kind, "bad", r.status_code, not why, seconds, why)


def _error_body_problem(r: httpx.Response, kind: str, ctx: Ctx) -> str:
    """Why a 4xx is not an OpenAI-style error (or, for a context error, does not name the limit)."""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI-style error body: {r.text[:200]}"
    if not error.get("message") or not error.get("type"):
        return f"error without message or type: {error}"
    if kind in CONTEXT_KINDS and (
        error.get("code") != "context_length_exceeded" or str(ctx.max_model_len) not in error["message"]
    ):
        return f"context error that does not name the limit {ctx.max_model_len}: {error}"
    return ""


def _raw_post(path: str, body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    head = f"POST {path} HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    return head.encode() + body


async def drop(kind: str, ctx: Ctx) -> Outcome:
    """A client that goes away early over a raw socket, half the time with a reset (abort) and half
    with a normal close. It is ok unless the server answered it with a 5xx before it left."""
    host, port = ctx.host_port
    gen = {"max_tokens": ctx.max_model_len // 2, "temperature": 1.0, "seed": ctx.rng.randint(0, 2**31)}
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    status: int | str = "closed"
    try:
        if kind == "drop_mid_upload":  # the headers promise twice the bytes that arrive
            body = _json(chat_body(ctx))
            writer.write(_raw_post("/v1/chat/completions", body[: len(body) // 2], length=len(body)))
            await writer.drain()
            await asyncio.sleep(ctx.rng.uniform(0.0, 0.2))
        elif kind == "drop_while_generating":
            writer.write(_raw_post("/v1/chat/completions", _json(chat_body(ctx, **gen))))
            await writer.drain()
            await asyncio.sleep(ctx.rng.uniform(0.05, 0.3))
        else:  # a stream: read the status line and a few events, then leave
            body = (
                chat_body(ctx, stream=True, **gen)
                if kind == "drop_mid_stream"
                else {"model": ctx.model, "prompt": prompt_ids(ctx), "stream": True, **gen}
            )
            path = "/v1/chat/completions" if kind == "drop_mid_stream" else "/v1/completions"
            writer.write(_raw_post(path, _json(body)))
            await writer.drain()
            status = int((await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)).split()[1])
            events = 0
            while status == 200 and events < ctx.rng.randint(1, 4):
                line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
                events += line.startswith(b"data: ")
    except (OSError, TimeoutError, IndexError, ValueError) as exc:
        return Outcome(kind, "bad", "error", False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    finally:
        if ctx.rng.random() < 0.5:
            writer.transport.abort()  # RST
        else:
            writer.close()  # FIN
    ok = status in ("closed", 200)
    return Outcome(kind, "bad", status, ok, time.perf_counter() - t0, "" if ok else f"status {status}")


# --- the storm ----------------------------------------------------------------------------------------


def plan(clients: int, bad_fraction: float, seed: int) -> list[str]:
    """The kind of each client, shuffled: round(clients * bad_fraction) bad ones cycling through every
    bad kind (so 16+ bad clients cover them all), the rest cycling through the good kinds."""
    n_bad = round(clients * bad_fraction)
    bad_kinds = list(BAD_KINDS)
    kinds = [bad_kinds[i % len(bad_kinds)] for i in range(n_bad)]
    kinds += [GOOD_KINDS[i % len(GOOD_KINDS)] for i in range(clients - n_bad)]
    random.Random(seed).shuffle(kinds)
    return kinds


async def storm(ctx: Ctx, kinds: list[str]) -> list[Outcome]:
    """Every client at once; the good ones share one connection pool, as a real client's calls do."""
    limits = httpx.Limits(max_connections=len(kinds) + 8, max_keepalive_connections=len(kinds) + 8)
    async with httpx.AsyncClient(base_url=ctx.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        return list(await asyncio.gather(*(good(k, client, ctx) if k in GOOD_KINDS else bad(k, ctx) for k in kinds)))


async def health(url: str) -> dict:
    """/health and /v1/models after the storm, and how long until no request is generating any more."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        t0 = time.perf_counter()
        while True:
            r = await client.get("/health")
            generating = r.json().get("generating") if r.status_code == 200 else None
            if not generating or time.perf_counter() - t0 > 30:
                break
            await asyncio.sleep(0.05)
        models = await client.get("/v1/models")
    return {
        "health_status": r.status_code,
        "models_status": models.status_code,
        "generating": generating,
        "drained_s": round(time.perf_counter() - t0, 2),
    }


async def server_info(url: str) -> tuple[str, int]:
    """(model id, max_model_len) from /v1/models; also proves the server answers."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
    return card["id"], card["max_model_len"]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (p95 of 80 values is the 76th smallest)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))] if ordered else float("nan")


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    """Counts per kind and status, 5xx and connection errors, and the good clients' latency."""
    goods = [o for o in outcomes if o.group == "good"]
    latencies = [o.seconds for o in goods if o.ok]
    return {
        "clients": len(outcomes),
        "good": len(goods),
        "bad": len(outcomes) - len(goods),
        "wall_s": round(wall, 2),
        "per_kind": dict(sorted(Counter(o.kind for o in outcomes).items())),
        "status_codes": {str(k): v for k, v in sorted(Counter(str(o.status) for o in outcomes).items())},
        "status_by_kind": {
            kind: dict(Counter(str(o.status) for o in outcomes if o.kind == kind))
            for kind in sorted({o.kind for o in outcomes})
        },
        "5xx": sum(isinstance(o.status, int) and o.status >= 500 for o in outcomes),
        "connection_errors": sum(o.status == "error" for o in outcomes),
        "good_ok": len(latencies),
        "good_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "good_p95_s": round(percentile(latencies, 0.95), 3) if latencies else None,
        "failures": [asdict(o) for o in outcomes if not o.ok][:20],
    }


def problems(result: dict) -> list[str]:
    """Every chaos property the run broke, in words (empty when the server came through whole)."""
    out = []
    storm_, after = result["storm"], result["after"]
    if storm_["5xx"] or after["5xx"]:
        out.append(f"{storm_['5xx'] + after['5xx']} responses were 5xx")
    if storm_["connection_errors"] or after["connection_errors"]:
        out.append(f"{storm_['connection_errors'] + after['connection_errors']} connection errors")
    if storm_["good_ok"] != storm_["good"]:
        out.append(f"only {storm_['good_ok']} of {storm_['good']} good clients got a valid completion")
    out += [f"{f['kind']}: {f['status']} {f['why'][:200]}" for f in storm_["failures"]]
    if not result["alive"]:
        out.append("the server process died")
    if result["health"]["health_status"] != 200 or result["health"]["models_status"] != 200:
        out.append(f"after the storm: {result['health']}")
    if result["health"]["generating"]:
        out.append(f"{result['health']['generating']} requests still generating for nobody 30 s after the storm")
    if after["good_ok"] != after["good"]:
        out.append(f"after the storm only {after['good_ok']} of {after['good']} good requests completed")
    if result["rss_growth_mb"] > result["rss_limit_mb"]:
        out.append(f"server memory grew by {result['rss_growth_mb']:.0f} MiB (limit {result['rss_limit_mb']})")
    if result["server_tracebacks"]:
        out.append(f"{result['server_tracebacks']} tracebacks in the server log")
    return out


async def chaos(server: Server, kinds: list[str], *, after: int, max_tokens: int, max_request_mb: float, seed: int):
    """Warm up, storm, then check the server: health, a further batch of good requests, memory."""
    model, max_model_len = await server_info(server.url)
    ctx = Ctx(server.url, model, max_model_len, max_tokens, int(max_request_mb * 2**20), random.Random(seed))
    await storm(ctx, ["chat"])  # first-request costs are not chaos
    rss_before = server.rss_mb()
    t0 = time.perf_counter()
    outcomes = await storm(ctx, kinds)
    wall = time.perf_counter() - t0
    checked = await health(server.url)
    t1 = time.perf_counter()
    later = await storm(ctx, [GOOD_KINDS[i % len(GOOD_KINDS)] for i in range(after)])
    return {
        "storm": summarize(outcomes, wall),
        "health": checked,
        "after": summarize(later, time.perf_counter() - t1),
        "alive": server.alive(),
        "rss_before_mb": round(rss_before),
        "rss_after_mb": round(server.rss_mb()),
        "rss_growth_mb": round(server.rss_mb() - rss_before),
    }


def run(
    model: str | Path | None = None,
    *,
    clients: int = 100,
    bad_fraction: float = 0.2,
    seed: int = 0,
    max_tokens: int = 8,
    after: int = 20,
    max_request_mb: float = 1.0,
    server_options: list[str] | None = None,
) -> dict:
    """The whole chaos run; returns the summary with its `problems` (empty when all properties hold).
    The server is started with `max_request_mb` unless `server_options` replaces its options."""
    with tempfile.TemporaryDirectory(prefix="chaos-serve-") as tmp:
        model = model or build_tiny_model(Path(tmp) / "tiny")
        options = [f"max_request_mb={max_request_mb}"] if server_options is None else server_options
        server = start_server(model, options, Path(tmp))
        try:
            kinds = plan(clients, bad_fraction, seed)
            result = asyncio.run(
                chaos(server, kinds, after=after, max_tokens=max_tokens, max_request_mb=max_request_mb, seed=seed)
            )
            result["server_alive_at_end"] = server.alive()
        finally:
            stop_server(server)
            tracebacks = server.tracebacks()
            log_tail = server.log.read_text(errors="replace")[-3000:]
    # memory: the storm's largest accepted body is max_request_mb; 256 MiB is far above what a request
    # within the limits costs and far below what an unlimited many-MB body costs (GBs once parsed)
    result |= {"rss_limit_mb": 256, "server_tracebacks": tracebacks, "server_options": options}
    result["problems"] = problems(result)
    if tracebacks:
        result["server_log_tail"] = log_tail
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--bad-fraction", type=float, default=0.2)
    parser.add_argument("--model", default=None, help="a model directory; default: a tiny random Llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=8, help="completion tokens of a good request")
    parser.add_argument("--after", type=int, default=20, help="good requests sent after the storm")
    parser.add_argument("--max-request-mb", type=float, default=1.0, help="the server's body limit")
    parser.add_argument(
        "--server-option", action="append", default=None, metavar="KEY=VALUE",
        help="options for agent-r1 serve instead of max_request_mb=... (repeatable)",
    )  # fmt: skip
    args = parser.parse_args()
    result = run(
        args.model, clients=args.clients, bad_fraction=args.bad_fraction, seed=args.seed,
        max_tokens=args.max_tokens, after=args.after, max_request_mb=args.max_request_mb,
        server_options=args.server_option,
    )  # fmt: skip
    print(json.dumps(result, indent=1))
    sys.exit(1 if result["problems"] else 0)


if __name__ == "__main__":
    # Run as a script, this directory heads sys.path, and its kernels.py would shadow the `kernels`
    # package that transformers probes for (a circular import when the tiny model is built).
    here = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != here]
    main()
