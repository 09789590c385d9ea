"""Regressions from the serve chaos run (benchmarks/chaos_serve.py): each test is one bug it found.

* a seed outside 64 bits reached the engine, whose torch generator refused it: a 500 for every request
  decoded in the same batch;
* a lone surrogate (JSON's `\\ud800`) reached the tokenizer: a 500;
* a body of any size was read whole and tokenized on the event loop: 50 MB took 2 GB and froze every
  other client for 44 s;
* a small body could ask for 50,000 prompts x n=64 rows, which held the engine (and its memory) for
  hours ahead of every other request;
* nothing showed whether a request was still generating for a client that had gone away.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.serve import ServedModel, create_app
from tests.conftest import serving

NAME = "tiny"
LIMIT = 64 * 1024  # the body limit of the server under test
ASK = {"model": NAME, "messages": [{"role": "user", "content": "What is 6 * 7?"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def served(tiny_model, tokenizer):
    engine = LocalEngine(tiny_model, tokenizer, max_context=1024, max_batch_size=8, seed=0)
    return ServedModel(
        engine,
        tokenizer,
        ChatFormat(tokenizer),
        NAME,
        engine.eos_ids,
        request_timeout=60.0,
        max_request_bytes=LIMIT,
        max_batch_size=8,
    )


@pytest.fixture
async def client(served):
    transport = httpx.ASGITransport(app=create_app(served))
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
        yield c


async def test_a_seed_outside_64_bits_is_a_400_and_does_not_fail_its_batch(client, served):
    served.engine.batch_wait_s = 0.2  # both requests arrive within it: before the fix they shared a batch
    bad, good = await asyncio.gather(
        client.post("/v1/chat/completions", json=ASK | {"seed": 2**64}),
        client.post("/v1/chat/completions", json=ASK | {"seed": 3}),
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
    assert good.status_code == 200, good.text
    edge = await client.post("/v1/chat/completions", json=ASK | {"seed": -(2**63)})
    assert edge.status_code == 200, edge.text  # the whole signed 64-bit range is served


SURROGATE = "What is \ud800 * 7?"  # json.dumps writes it as the escape "\ud800": valid JSON
UNICODE_CASES = [
    ("/v1/chat/completions", ASK | {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    (
        "/v1/chat/completions",
        ASK | {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
        "messages.0.content.0.text",
    ),
    (
        "/v1/chat/completions",
        ASK | {"tools": [{"type": "function", "function": {"name": "f", "description": SURROGATE}}]},
        "tools.0.function.description",
    ),
    ("/v1/completions", {"model": NAME, "prompt": SURROGATE, "max_tokens": 2}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), UNICODE_CASES)
async def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, body, param):
    r = await client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "not valid Unicode" in r.json()["error"]["message"]
    assert (
        await client.post("/v1/chat/completions", json=ASK | {"messages": [{"role": "user", "content": "é"}]})
    ).status_code == 200


def big_chat(size: int) -> bytes:
    """A chat request of about `size` bytes (words, which tokenize at ~2 MB/s)."""
    return json.dumps(ASK | {"messages": [{"role": "user", "content": "hello world " * (size // 12)}]}).encode()


async def test_a_body_over_the_limit_is_a_413_before_it_is_read(client):
    r = await client.post(
        "/v1/chat/completions", content=big_chat(4 * LIMIT), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]


async def test_a_chunked_body_is_counted_and_refused_once_past_the_limit(client):
    read = 0

    async def chunks():
        nonlocal read
        for _ in range(64):  # 64 x 8 KiB = 8x the limit, with no Content-Length
            read += 1
            yield b" " * 8192

    r = await client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert read <= LIMIT // 8192 + 2  # refused once past the limit, not after reading all of it


async def test_a_body_within_the_limit_is_served(client):
    body = big_chat(LIMIT - 1024)  # under the limit in bytes, over the context in tokens
    r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_more_rows_than_one_batch_is_a_400_naming_the_limit(client):
    rows = {"model": NAME, "prompt": [[7]] * 1000, "n": 64, "max_tokens": 1}  # 64,000 rows in 5 KB
    r = await client.post("/v1/completions", json=rows)
    assert r.status_code == 400 and "max_batch_size" in r.json()["error"]["message"]
    assert "8 rows" in r.json()["error"]["message"]  # the served engine's max_batch_size
    ok = await client.post("/v1/completions", json=rows | {"prompt": [[7], [8]], "n": 4})  # 8 rows: one batch
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8


async def test_a_huge_prompt_is_tokenized_off_the_event_loop(served, client):
    """While megabytes of prompt are tokenized, /health still answers: before the fix the tokenizer ran
    on the event loop, so /health waited for the whole tokenization and answered after the big request."""
    served.max_request_bytes = 8 * 2**20
    app = create_app(served)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as c:
        finished = []

        async def post_big():
            r = await c.post(
                "/v1/chat/completions", content=big_chat(2 * 2**20), headers={"content-type": "application/json"}
            )
            finished.append("big")
            return r

        big = asyncio.ensure_future(post_big())
        await asyncio.sleep(0.05)  # the big request is being tokenized
        health = await c.get("/health")
        finished.append("health")
        assert (await big).status_code == 400
    assert health.status_code == 200
    assert finished == ["health", "big"]


def test_health_counts_generating_requests_until_a_client_leaves(served, tokenizer):
    body = {"model": NAME, "prompt": tokenizer.encode("Hello"), "max_tokens": 900, "temperature": 1.0, "stream": True}
    with serving(create_app(served)) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").json() == {"status": "ok", "generating": 0}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert http.get("/health").json()["generating"] == 1
        for _ in range(3000):  # bounded wait for the server to notice the disconnect
            if http.get("/health").json()["generating"] == 0:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert http.get("/health").json()["generating"] == 0


async def test_requests_wait_for_kv_memory_instead_of_exceeding_it(tiny_model, tokenizer):
    """A KV budget of three 256-token slots and 12 concurrent chats: the engine runs a few at a time,
    never holds more than the budget, and answers every request as an unconstrained engine does."""
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32 bytes
    budget_gb = 3 * 256 * per_token / 2**30
    questions = [f"What is {i} * {i + 3}?" for i in range(12)]
    answers = {}
    for name, gb in (("tight", budget_gb), ("roomy", 4.0)):
        engine = LocalEngine(tiny_model, tokenizer, max_context=1024, max_batch_size=8, seed=0, kv_cache_gb=gb)
        served = ServedModel(
            engine, tokenizer, ChatFormat(tokenizer), NAME, engine.eos_ids, request_timeout=60.0, max_batch_size=8
        )
        held = []
        hook = tiny_model.register_forward_pre_hook(lambda *_, e=engine, h=held: h.append(e._cache.nbytes))
        try:
            transport = httpx.ASGITransport(app=create_app(served))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                asks = [ASK | {"messages": [{"role": "user", "content": q}], "max_tokens": 8} for q in questions]
                rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=a) for a in asks))
        finally:
            hook.remove()
        assert [r.status_code for r in rs] == [200] * 12
        answers[name] = [r.json()["choices"][0]["message"]["content"] for r in rs]
        if name == "tight":
            assert max(held) <= engine.kv_cache_bytes
    assert answers["tight"] == answers["roomy"]
