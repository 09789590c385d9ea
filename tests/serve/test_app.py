"""The OpenAI-compatible API, over HTTP: a real model (the tiny tool-call model) behind every endpoint."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.models.vision import png_data_url
from agent_r1.serve import ServedModel, create_app
from agent_r1.tools import calculator
from tests.conftest import TOOL_ANSWER, TOOL_QUESTION, make_tiny_llama, recorded_passes, serving

NAME = "tool-model"


@pytest.fixture(scope="module")
def model(tool_model_dir):
    return AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()


@pytest.fixture
def served(model, tokenizer):
    engine = LocalEngine(model, tokenizer, max_context=512, seed=0)
    return ServedModel(engine, tokenizer, ChatFormat(tokenizer), NAME, engine.eos_ids, request_timeout=60.0)


@pytest.fixture
async def client(served):
    transport = httpx.ASGITransport(app=create_app(served))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def until_idle(engine: LocalEngine, timeout: float = 30) -> None:
    for _ in range(int(timeout / 0.01)):
        if engine.idle:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine is still decoding")


CALCULATOR = [calculator.schema]
ASK = {"model": NAME, "messages": [{"role": "user", "content": TOOL_QUESTION}], "tools": CALCULATOR, "temperature": 0}


def sse_events(text: str) -> list:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_models_lists_the_served_model(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    (card,) = r.json()["data"]
    assert card["id"] == NAME and card["max_model_len"] == 512


async def test_chat_returns_parsed_tool_calls(client):
    r = await client.post("/v1/chat/completions", json=ASK)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "6 * 7"}
    assert choice["message"]["content"] is None


async def test_tool_results_are_rendered_exactly_as_the_agent_loop_renders_them(client, served):
    first = (await client.post("/v1/chat/completions", json=ASK | {"return_token_ids": True})).json()
    call = first["choices"][0]["message"]["tool_calls"][0]
    messages = [
        *ASK["messages"],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "42"},
    ]
    second = (
        await client.post("/v1/chat/completions", json=ASK | {"messages": messages, "return_token_ids": True})
    ).json()
    assert second["choices"][0]["message"] == {"role": "assistant", "content": TOOL_ANSWER}
    assert second["choices"][0]["finish_reason"] == "stop"
    # the second prompt is token for token the context ToolEnv builds: prompt + sampled call + tool turn
    continuation = served.prompt_format.continuation(
        [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}], False
    )
    assert second["prompt_token_ids"] == first["prompt_token_ids"] + first["choices"][0]["token_ids"] + continuation


async def test_streamed_chat_matches_the_whole_response(client):
    whole = (await client.post("/v1/chat/completions", json=ASK)).json()["choices"][0]
    r = await client.post("/v1/chat/completions", json=ASK | {"stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert [c["function"] | {"index": c["index"]} for c in last["delta"]["tool_calls"]] == [
        c["function"] | {"index": 0} for c in whole["message"]["tool_calls"]
    ]
    plain = ASK | {"tools": None, "max_tokens": 12}  # no tools: the same tokens stream as prose
    streamed = sse_events((await client.post("/v1/chat/completions", json=plain | {"stream": True})).text)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed)
    assert text == (await client.post("/v1/chat/completions", json=plain)).json()["choices"][0]["message"]["content"]
    assert len(streamed) > 3  # token by token, not one blob


async def test_completions_take_and_return_token_ids_with_logprobs(client, served, tokenizer):
    prompt = ChatFormat(tokenizer).initial([{"role": "user", "content": "Hello"}])
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 11, "logprobs": 0}
    r = await client.post("/v1/completions", json=body | {"return_token_ids": True, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    (ref,) = await served.engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0, seed=11))
    assert choice["token_ids"] == ref.token_ids and choice["prompt_token_ids"] == prompt
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    assert r.json()["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8}


async def test_completions_finish_reasons_follow_vllm(client, tokenizer, served):
    prompt = served.prompt_format.initial(
        [{"role": "system", "content": served_system()}, {"role": "user", "content": TOOL_QUESTION}]
    )
    body = {"model": NAME, "prompt": prompt, "temperature": 0, "max_tokens": 64}
    stop = (await client.post("/v1/completions", json=body | {"stop": ["</tool_call>"]})).json()["choices"][0]
    assert (stop["finish_reason"], stop["stop_reason"]) == ("stop", "</tool_call>")
    assert stop["text"].startswith("<tool_call>") and "</tool_call>" not in stop["text"]
    kept = await client.post(
        "/v1/completions", json=body | {"stop": "</tool_call>", "include_stop_str_in_output": True}
    )
    assert kept.json()["choices"][0]["text"].endswith("</tool_call>")
    short = (await client.post("/v1/completions", json=body | {"max_tokens": 3})).json()["choices"][0]
    assert (short["finish_reason"], short["stop_reason"]) == ("length", None)
    n2 = await client.post("/v1/completions", json=body | {"prompt": [prompt, prompt[:-1]], "n": 2, "max_tokens": 2})
    assert [c["index"] for c in n2.json()["choices"]] == [0, 1, 2, 3]


def served_system() -> str:
    from agent_r1.env.tool_calls import tools_system_prompt

    return tools_system_prompt(CALCULATOR)


async def test_streamed_completion_reports_every_token(client, tokenizer):
    prompt = tokenizer.encode("Hello there")
    body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    events = sse_events((await client.post("/v1/completions", json=body | {"stream": True})).text)
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == whole["token_ids"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


BAD_SCHEMA = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}
LONG = [{"role": "user", "content": "x " * 600}]
BAD = [
    ("/v1/chat/completions", b'{"model": "tool-model", "messages": [', 400, "not valid JSON", None),
    ("/v1/chat/completions", ASK | {"model": "gpt-4"}, 404, "does not exist", "model_not_found"),
    ("/v1/chat/completions", {"model": NAME}, 400, "messages", None),
    ("/v1/chat/completions", ASK | {"temperature": -1}, 400, "temperature", None),
    ("/v1/chat/completions", ASK | {"tools": [{"type": "function", "function": BAD_SCHEMA}]}, 400, "tool 'f'", None),
    ("/v1/chat/completions", ASK | {"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "a b", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object", None),
    ("/v1/chat/completions", ASK | {"messages": LONG}, 400, "maximum context length", "context_length_exceeded"),
    ("/v1/chat/completions", ASK | {"max_tokens": 10_000}, 400, "maximum context length", "context_length_exceeded"),
    ("/v1/completions", {"model": NAME, "prompt": [1, 2, 10**9]}, 400, "token ids must be in", None),
    ("/v1/completions", {"model": NAME, "prompt": []}, 400, "prompt", None),
    ("/v1/nowhere", {}, 404, "Not Found", None),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "message", "code"), BAD)
async def test_bad_input_is_an_openai_style_4xx_and_the_server_keeps_serving(client, path, body, status, message, code):
    json_header = {"content-type": "application/json"}
    r = await client.post(
        path, **({"content": body, "headers": json_header} if isinstance(body, bytes) else {"json": body})
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"] and error["code"] == code and error["type"]
    assert (await client.post("/v1/chat/completions", json=ASK | {"max_tokens": 2})).status_code == 200


async def test_concurrent_requests_are_decoded_as_one_batch(client, served, tokenizer):
    served.engine.batch_wait_s = 0.2  # in-process requests all arrive well within this
    prompts = [tokenizer.encode(f"Question {i}") for i in range(4)]
    body = {"model": NAME, "max_tokens": 3, "temperature": 0}
    with recorded_passes() as passes:
        rs = await asyncio.gather(*(client.post("/v1/completions", json=body | {"prompt": p}) for p in prompts))
    assert all(r.status_code == 200 for r in rs)
    assert [len(chunks) for _, chunks in passes if chunks] == [4]  # one pass prefills the four prompts


async def test_a_request_past_its_deadline_is_a_504_and_its_row_is_dropped(served, tokenizer):
    served.request_timeout = 0.05
    transport = httpx.ASGITransport(app=create_app(served))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {"model": NAME, "prompt": tokenizer.encode("Hello"), "max_tokens": 480, "temperature": 1.0}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        await until_idle(served.engine)  # the engine goes idle instead of decoding 480 tokens
    assert served.engine.stats["aborted"] == 1 and served.engine.stats["decode_steps"] < 470


def test_client_disconnect_mid_stream_stops_generation(served, tokenizer):
    stats = served.engine.stats
    body = {"model": NAME, "prompt": tokenizer.encode("Hello"), "max_tokens": 480, "temperature": 1.0, "stream": True}
    with serving(create_app(served)) as url, httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(4)]  # a few tokens arrived, then the client goes away
        assert first[0].startswith("data: ")
        asyncio.run(until_idle(served.engine))  # the server notices and the engine drops the row
    assert stats["aborted"] == 1 and stats["decode_steps"] < 470


# --- /v1/load_weights -----------------------------------------------------------------------------------


def tiny(tokenizer, seed: int):
    """A tiny Llama whose final norm gain is random, so that two seeds greedily decode different tokens."""
    model = make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.normal_(0.0, 3.0)
    return model


@pytest.fixture
def tiny_served(tokenizer):
    engine = LocalEngine(tiny(tokenizer, seed=3), tokenizer, max_context=256, seed=0)
    return ServedModel(
        engine, tokenizer, ChatFormat(tokenizer), NAME, engine.eos_ids, request_timeout=60.0, allow_weight_updates=True
    )


@pytest.fixture
async def tiny_client(tiny_served):
    transport = httpx.ASGITransport(app=create_app(tiny_served))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def weights_file(path, model, drop=(), **replace) -> str:
    """`model`'s weights as safetensors, the tied lm_head written once (as RemoteEngine writes them)."""
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" and k not in drop}
    save_file(state | {k.replace("__", "."): v for k, v in replace.items()}, str(path))
    return str(path)


async def greedy_ids(client, prompt: list[int], max_tokens: int = 8) -> list[int]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


async def weights_version(client) -> int:
    return (await client.get("/v1/models")).json()["data"][0]["weights_version"]


async def test_load_weights_swaps_the_served_model(tiny_client, tokenizer, tmp_path):
    other = tiny(tokenizer, seed=4)
    prompt = tokenizer.encode("Hello there, how are")
    (want,) = await LocalEngine(other, tokenizer).generate([prompt], SamplingParams(max_new_tokens=8, temperature=0))
    before = await greedy_ids(tiny_client, prompt)
    assert before != want.token_ids and await weights_version(tiny_client) == 0
    path = weights_file(tmp_path / "w.safetensors", other)
    r = await tiny_client.post("/v1/load_weights", json={"path": path, "version": 7})
    assert r.status_code == 200, r.text
    assert r.json() == {"loaded": len(other.state_dict()) - 1, "version": 7}
    assert await greedy_ids(tiny_client, prompt) == want.token_ids
    assert await weights_version(tiny_client) == 7
    r = await tiny_client.post("/v1/load_weights", json={"path": path})  # no version: the previous + 1
    assert r.json()["version"] == 8 and await weights_version(tiny_client) == 8


async def test_load_weights_waits_for_the_batch_being_decoded(tiny_client, tiny_served, tokenizer, tmp_path):
    """A response is sampled from one version of the weights: the update lands between batches."""
    prompt = tokenizer.encode("Hello there, how are")
    params = SamplingParams(max_new_tokens=120, temperature=0)
    (old,) = await tiny_served.engine.generate([prompt], params)
    path = weights_file(tmp_path / "w.safetensors", tiny(tokenizer, seed=4))
    decoding = asyncio.ensure_future(greedy_ids(tiny_client, prompt, max_tokens=120))
    while not tiny_served.engine._weights_lock.locked():  # the batch is decoding
        await asyncio.sleep(0.001)
    load = await tiny_client.post("/v1/load_weights", json={"path": path})
    assert load.status_code == 200
    assert await decoding == old.token_ids  # all 120 tokens from the old weights: the load waited
    assert await greedy_ids(tiny_client, prompt) != old.token_ids[:8]


async def test_load_weights_between_tokens_is_a_boolean_and_tokens_say_their_version(tiny_client, tokenizer, tmp_path):
    path = weights_file(tmp_path / "w.safetensors", tiny(tokenizer, seed=4))
    bad = await tiny_client.post("/v1/load_weights", json={"path": path, "between_tokens": "sometimes"})
    assert bad.status_code == 400
    assert (
        bad.json()["error"]["message"] == "between_tokens: Input should be a valid boolean, unable to interpret input"
    )
    assert await weights_version(tiny_client) == 0  # refused before anything was read
    ok = await tiny_client.post("/v1/load_weights", json={"path": path, "version": 3, "between_tokens": True})
    assert ok.status_code == 200 and ok.json()["version"] == 3
    prompt = tokenizer.encode("Hello there")
    body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    completion = (await tiny_client.post("/v1/completions", json=body)).json()["choices"][0]
    assert completion["token_versions"] == [3] * len(completion["token_ids"]) == [3] * 4
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    chat_choice = (await tiny_client.post("/v1/chat/completions", json=chat | {"return_token_ids": True})).json()
    assert chat_choice["choices"][0]["token_versions"] == [3] * len(chat_choice["choices"][0]["token_ids"])
    plain = (await tiny_client.post("/v1/completions", json=body | {"return_token_ids": False})).json()["choices"][0]
    assert "token_versions" not in plain and "token_ids" not in plain  # OpenAI's shape unless asked


def junk(path) -> str:
    path.write_bytes(b"not a safetensors file")
    return str(path)


BAD_WEIGHTS = [  # (a function of (tmp dir, a good model) giving the path to post, the expected message)
    pytest.param(lambda p, m: str(p / "nowhere.safetensors"), "no weights file at", id="missing file"),
    pytest.param(lambda p, m: junk(p / "x.safetensors"), "cannot read", id="not safetensors"),
    pytest.param(
        lambda p, m: weights_file(p / "x.safetensors", m, model__extra__weight=torch.zeros(2)),
        "unknown tensor 'model.extra.weight'", id="unknown tensor",
    ),
    pytest.param(
        lambda p, m: weights_file(p / "x.safetensors", m, model__norm__weight=torch.zeros(3)),
        "tensor 'model.norm.weight' has shape [3] but the served model's is [64]", id="wrong shape",
    ),
    pytest.param(
        lambda p, m: weights_file(p / "x.safetensors", m, drop=("model.norm.weight",)),
        "missing tensor 'model.norm.weight'", id="missing tensor",
    ),
    pytest.param(None, "path: Field required", id="no path"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "message"), BAD_WEIGHTS)
async def test_bad_weights_are_a_400_and_the_served_weights_stay(
    tiny_client, tiny_served, tokenizer, tmp_path, make, message
):
    model = tiny_served.engine.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = tokenizer.encode("Hello there")
    served_ids = await greedy_ids(tiny_client, prompt)
    r = await tiny_client.post("/v1/load_weights", json={"path": make(tmp_path, tiny(tokenizer, 4))} if make else {})
    assert r.status_code == 400
    error = r.json()["error"]["message"]
    assert message in error and "\n" not in error
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing half-loaded
    assert await weights_version(tiny_client) == 0
    assert await greedy_ids(tiny_client, prompt) == served_ids  # still serving, the same weights


async def test_load_weights_is_refused_unless_the_server_allows_it(client, tokenizer, tmp_path):
    """A plain `agent-r1 serve` (allow_weight_updates off) never lets a client replace its model."""
    r = await client.post(
        "/v1/load_weights", json={"path": weights_file(tmp_path / "w.safetensors", tiny(tokenizer, 4))}
    )
    assert r.status_code == 403 and "allow_weight_updates=true" in r.json()["error"]["message"]


async def test_a_vision_model_answers_image_url_parts_as_the_agent_loop_would(tiny_llava):
    """An OpenAI image_url part (a data URL) reaches the vision tower: the answer is the one the engine
    gives for the same prompt ids and image, and a different picture changes it."""
    from agent_r1.env.prompt_format import prompt_format_for
    from tests.conftest import picture

    model, processor = tiny_llava
    fmt = prompt_format_for(processor)
    engine = LocalEngine(model, processor.tokenizer, seed=0)
    served = ServedModel(engine, processor.tokenizer, fmt, NAME, engine.eos_ids)
    transport = httpx.ASGITransport(app=create_app(served))

    def ask(url):
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        return {
            "model": NAME,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": 8,
            "logprobs": True,
            "return_token_ids": True,
        }

    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        a, b, bad, remote = [
            await c.post("/v1/chat/completions", json=ask(url))
            for url in (
                png_data_url(picture(1)),
                png_data_url(picture(2)),
                "data:image/png;base64,AAAA",
                "http://x.org/p.png",
            )
        ]
    assert a.status_code == b.status_code == 200
    messages = [
        {"role": "user", "content": [{"type": "image", "image": picture(1)}, {"type": "text", "text": "What is it?"}]}
    ]
    ids = a.json()["prompt_token_ids"]
    assert ids == fmt.initial(messages)
    engine = LocalEngine(model, processor.tokenizer, seed=0)
    (want,) = engine.generate_batch(
        [ids], SamplingParams(max_new_tokens=8, temperature=0.0), [0], images=[fmt.images(messages)]
    )
    assert a.json()["choices"][0]["token_ids"] == want.token_ids
    assert [t["logprob"] for t in a.json()["choices"][0]["logprobs"]["content"]] == pytest.approx(
        want.logprobs, abs=1e-4
    )
    assert a.json()["choices"][0]["logprobs"] != b.json()["choices"][0]["logprobs"]
    assert bad.status_code == 400 and "cannot read image" in bad.json()["error"]["message"]
    assert remote.status_code == 400 and "data: URL" in remote.json()["error"]["message"]


async def test_a_text_only_model_refuses_images_in_one_line(client):
    from tests.conftest import picture

    content = [{"type": "image_url", "image_url": {"url": png_data_url(picture(0))}}, {"type": "text", "text": "hi"}]
    r = await client.post(
        "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": content}]}
    )
    assert (
        r.status_code == 400
        and r.json()["error"]["message"] == f"the request has 1 image(s) but {NAME} reads text only"
    )


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        ([f"s{i}" for i in range(17)], "at most 16 stop sequences, got 17"),
        ("x" * 257, "a stop sequence is at most 256 characters, got one of 257"),
    ],
)
async def test_stop_strings_are_bounded_in_number_and_length(client, stop, message):
    """Every decoded token is checked against the stop strings on the decode thread all requests share."""
    r = await client.post("/v1/chat/completions", json=ASK | {"stop": stop})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    ok = await client.post("/v1/chat/completions", json=ASK | {"stop": ["s"] * 16, "max_tokens": 2})
    assert ok.status_code == 200
