"""`serve --learn` over HTTP with a real (tiny) model: every request is committed before its answer, with the
exact ids and log-probs the engine sampled; sessions, exploration, redaction and feedback."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from transformers import AutoModelForCausalLM

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.online.record import INTERACTION_HEADER, Recorder
from agent_r1.online.store import Store
from agent_r1.serve import ServedModel, create_app
from agent_r1.serve.server import RecordConfig, ServeConfig, _recorder
from agent_r1.tools import calculator
from tests.conftest import TOOL_QUESTION

NAME = "tool-model"


@pytest.fixture(scope="module")
def model(tool_model_dir):
    return AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()


def make_client(model, tokenizer, store, **recorder):
    engine = LocalEngine(model, tokenizer, max_context=512, seed=0)
    served = ServedModel(
        engine, tokenizer, ChatFormat(tokenizer), NAME, engine.eos_ids, request_timeout=60.0,
        recorder=Recorder(store, **recorder),
    )  # fmt: skip
    transport = httpx.ASGITransport(app=create_app(served))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "store.db"))
    yield s
    s.close()


def ask(content: str, **extra) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 12} | extra


async def test_a_request_is_stored_with_the_ids_and_logprobs_it_was_answered_with(model, tokenizer, store):
    async with make_client(model, tokenizer, store) as client:
        body = ask(TOOL_QUESTION, tools=[calculator.schema], return_token_ids=True, logprobs=True, temperature=1.0)
        reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    (stored,) = store.untrained()  # committed before the answer came back
    assert reply.headers[INTERACTION_HEADER] == answer["id"] == stored.id
    choice = answer["choices"][0]
    assert stored.prompt_ids == answer["prompt_token_ids"]
    assert stored.response_ids == choice["token_ids"]
    assert stored.logprobs == pytest.approx([t["logprob"] for t in choice["logprobs"]["content"]], abs=1e-6)
    assert stored.versions == choice["token_versions"] == [0] * len(stored.response_ids)
    assert stored.user_text == TOOL_QUESTION and stored.served and stored.asks and stored.turn == 0


async def test_a_conversation_resent_with_its_answer_stays_one_session(model, tokenizer, store):
    async with make_client(model, tokenizer, store) as client:
        first = (await client.post("/v1/chat/completions", json=ask("hello there"))).json()
        reply = first["choices"][0]["message"]
        history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": reply["content"]}]
        more = [*history, {"role": "user", "content": "more"}]
        await client.post("/v1/chat/completions", json=ask("and again") | {"messages": more})
        await client.post("/v1/chat/completions", json=ask("hello there"))  # the same opening: a new session
        named = await client.post("/v1/chat/completions", json=ask("x"), headers={"x-session-id": "mine"})
        await client.post("/v1/chat/completions", json=ask("y"), headers={"x-session-id": "mine"})
        await client.post("/v1/chat/completions", json=ask("z", user="alice"))
    rows = store.untrained()
    assert named.headers["x-session-id"] == "mine"  # the client learns its session, for session feedback
    assert [r.turn for r in rows] == [0, 1, 0, 0, 1, 0]
    assert rows[0].session == rows[1].session != rows[2].session
    assert rows[3].session == rows[4].session == "mine"
    assert rows[5].user == "alice" and rows[0].user == rows[0].session  # unnamed: the session is the user


async def test_exploration_samples_n_answers_serves_one_and_stores_all(model, tokenizer, store):
    async with make_client(model, tokenizer, store, explore=1.0, explore_n=3) as client:
        reply = await client.post("/v1/chat/completions", json=ask("pick", temperature=1.0))
    assert len(reply.json()["choices"]) == 1
    rows = store.untrained()
    assert len(rows) == 3 and len({r.request for r in rows}) == 1
    assert [r.served for r in rows] == [True, False, False]
    assert rows[0].id == reply.json()["id"] and len({r.prompt_hash for r in rows}) == 1


async def test_a_streamed_answer_is_committed_before_the_stream_ends(model, tokenizer, store):
    body = ask("stream it", stream=True)
    async with (
        make_client(model, tokenizer, store) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as reply,
    ):
        interaction = reply.headers[INTERACTION_HEADER]
        text = "".join([chunk async for chunk in reply.aiter_text()])
    assert text.rstrip().endswith("data: [DONE]")
    (stored,) = store.untrained()
    assert stored.id == interaction
    content = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in text.splitlines()
        if line.startswith("data: {")
    )
    assert stored.answer == content


async def test_redaction_runs_before_storage(model, tokenizer, store):
    def redact(text: str) -> str:
        return re.sub(r"\d", "#", text)

    async with make_client(model, tokenizer, store, redact=redact) as client:
        reply = await client.post("/v1/chat/completions", json=ask("my card is 4242", return_token_ids=True))
    (stored,) = store.untrained()
    assert stored.user_text == "my card is ####"
    assert "4242" not in tokenizer.decode(stored.prompt_ids) and "####" in tokenizer.decode(stored.prompt_ids)
    assert reply.json()["prompt_token_ids"] != stored.prompt_ids  # the prompt was rendered again, redacted
    assert stored.trainable  # the answer had nothing to redact


async def test_an_answer_that_redaction_changes_is_kept_as_text_and_never_trained(model, tokenizer, store):
    async with make_client(model, tokenizer, store, redact=lambda t: t.replace("a", "@")) as client:
        reply = await client.post("/v1/chat/completions", json=ask("hello", temperature=1.0, seed=2, max_tokens=24))
    content = reply.json()["choices"][0]["message"]["content"]
    (stored,) = store.untrained()
    assert stored.answer == content.replace("a", "@")
    assert stored.trainable == ("a" not in content)
    assert "a" in content  # this seed's answer has one: the case under test


async def test_feedback_is_stored_and_bad_feedback_is_a_4xx(model, tokenizer, store):
    async with make_client(model, tokenizer, store) as client:
        answer = (await client.post("/v1/chat/completions", json=ask("rate me"))).json()
        session = store.untrained()[0].session
        ok = await client.post("/v1/feedback", json={"response_id": answer["id"], "score": 0.5, "comment": "meh"})
        ok2 = await client.post("/v1/feedback", json={"session_id": session, "score": 1})
        unknown = await client.post("/v1/feedback", json={"response_id": "chatcmpl-nope", "score": 1})
        out_of_range = await client.post("/v1/feedback", json={"response_id": answer["id"], "score": 7})
        neither = await client.post("/v1/feedback", json={"score": 1})
        malformed = await client.post("/v1/feedback", json={"response_id": answer["id"], "score": "great"})
        status = (await client.get("/v1/learn")).json()
    assert ok.status_code == ok2.status_code == 200
    assert unknown.status_code == 404 and "chatcmpl-nope" in unknown.json()["error"]["message"]
    assert out_of_range.status_code == 400 and "score" in out_of_range.json()["error"]["message"]
    assert neither.status_code == 400 and malformed.status_code == 400
    got = store.rewards([answer["id"]], [session])
    assert [(r["source"], r["score"], json.loads(r["detail"])) for r in got] == [
        ("explicit", 0.5, {"comment": "meh"}),
        ("explicit", 1.0, {}),
    ]
    assert status["interactions"] == 1 and status["rewards/explicit"] == 2


async def test_a_store_that_fails_answers_503_and_serving_goes_on(model, tokenizer, store, monkeypatch):
    async with make_client(model, tokenizer, store) as client:

        def broken(rows, now=None):
            raise OSError("disk full")

        monkeypatch.setattr(store, "record", broken)
        down = await client.post("/v1/chat/completions", json=ask("hello"))
        monkeypatch.undo()
        up = await client.post("/v1/chat/completions", json=ask("hello"))
    assert down.status_code == 503 and "disk full" in down.json()["error"]["message"]
    assert up.status_code == 200 and len(store.untrained()) == 1


def test_a_restarted_server_comes_back_on_the_serving_version(tokenizer, tmp_path):
    from tests.conftest import make_tiny_llama
    from tests.serve.test_app import weights_file

    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=5)
    path = weights_file(tmp_path / "v.safetensors", model)
    store = Store(str(tmp_path / "store.db"))
    store.add_version(3, path, 0.5, "serving")
    store.add_version(4, path, 0.6, "serving")
    store.close()
    engine = LocalEngine(make_tiny_llama(len(tokenizer), seed=1), tokenizer, max_context=64)
    cfg = ServeConfig(learn=True, online=RecordConfig(store=str(tmp_path / "store.db")))
    recorder = _recorder(cfg, engine)
    assert engine.weights_version == 1
    served = engine.model.state_dict()
    assert all((served[k] == v).all() for k, v in model.state_dict().items())
    recorder.store.close()
