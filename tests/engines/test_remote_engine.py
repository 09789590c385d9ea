"""RemoteEngine against a real `agent-r1 serve` process on loopback: the same rollouts as LocalEngine.
Weight sync: after `sync_weights(model)` the server (and a LocalEngine) samples exactly what `model` does.
Partial rollouts: a `between_tokens` load lands mid-response, which then says which tokens came from which
version; the version check still catches weights this engine never pushed. vLLM's side is faked here."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors import safe_open

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams, full_state_dict
from agent_r1.engines.remote_engine import RemoteEngine, RemoteEngineError, parse_choice
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.models import load_model
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.serve import ServedModel, create_app
from agent_r1.tools import calculator
from tests.conftest import TOOL_QUESTION, make_tiny_llama, recompute_logprobs, serving

TASKS = [{"question": TOOL_QUESTION}, {"question": "What is 2 + 2?"}, {"question": "Hi"}]


@pytest.fixture(scope="module")
def server_url(tool_model_dir):
    """`agent-r1 serve` in a subprocess on a free loopback port; stopped after the module."""
    env = os.environ | {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "agent_r1.cli", "serve", f"model={tool_model_dir}", "port=0", "log_level=warning"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            line = proc.stdout.readline()  # the server prints its address once it has bound the port
            if not line.startswith("agent-r1 serve:"):
                log.seek(0)
                pytest.fail(f"agent-r1 serve did not start: {line}{log.read()[-2000:]}")
            yield line.split(" at ")[1].strip()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def rollout(engine, tokenizer, sampling):
    make_env = lambda: ToolEnv({"calculator": calculator}, ChatFormat(tokenizer))  # noqa: E731
    return AgentEnvLoop(engine, make_env, sampling, seed=0).run_sync(TASKS, group_size=2)


def test_greedy_rollout_through_the_server_matches_the_local_engine(server_url, tool_model_dir, tokenizer):
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0)
    model, _ = load_model(str(tool_model_dir))  # the server's loader and kernels
    local = rollout(LocalEngine(model, tokenizer), tokenizer, sampling)
    remote = rollout(RemoteEngine(server_url), tokenizer, sampling)
    assert len(local[0].steps) == 2 and local[0].steps[0].info["tool_calls"] == 1  # a real multi-turn episode
    for a, b in zip(local, remote, strict=True):
        assert (a.termination, a.error, len(a.steps)) == (b.termination, b.error, len(b.steps))
        for s, t in zip(a.steps, b.steps, strict=True):
            assert s.prompt_ids == t.prompt_ids and s.response_ids == t.response_ids and s.text == t.text
            assert t.response_logprobs == pytest.approx(s.response_logprobs, abs=1e-4)


def test_sampled_rollout_through_the_server_returns_exact_logprobs(server_url, tool_model_dir, tokenizer):
    """Sampled tokens are not compared with the local engine's: the server batches requests as they
    arrive, rows round differently in differently shaped batches (fp32), and the tiny model's
    near-uniform distributions turn that into other samples. What must hold: every returned
    log-prob is the one a plain forward pass over the episode's exact ids gives."""
    episodes = rollout(RemoteEngine(server_url), tokenizer, SamplingParams(max_new_tokens=40, temperature=1.0))
    model, _ = load_model(str(tool_model_dir))
    steps = [s for e in episodes for s in e.steps]
    assert len(steps) >= len(episodes) and all(len(s.response_ids) == len(s.response_logprobs) > 0 for s in steps)
    for s in steps:
        ref = recompute_logprobs(model, s.prompt_ids + s.response_ids)[len(s.prompt_ids) - 1 :]
        assert (ref - torch.tensor(s.response_logprobs)).abs().max().item() < 1e-4


def test_model_and_context_come_from_the_server(server_url, tool_model_dir):
    engine = RemoteEngine(server_url.removesuffix("/v1") + "/")  # the root works as well as .../v1
    assert engine.model == tool_model_dir.name and engine.max_context == 1024
    with pytest.raises(RemoteEngineError, match="does not serve 'gpt-4'"):
        RemoteEngine(server_url, model="gpt-4")


def test_server_errors_reach_the_caller_with_the_servers_message(server_url):
    engine = RemoteEngine(server_url)
    with pytest.raises(RemoteEngineError, match="400: This model's maximum context length is 1024"):
        asyncio.run(engine.generate([[1] * 1024], SamplingParams(max_new_tokens=4)))


def test_parse_choice_reads_vllm_shapes():
    old_vllm = {
        "text": "hi",
        "logprobs": {"tokens": ["token_id:5", "token_id:2"], "token_logprobs": [-0.5, -0.1]},
        "finish_reason": "stop",
        "stop_reason": 2,  # a stop token id: an EOS
    }
    out = parse_choice(old_vllm, prompt_len=3, version=4)
    assert (out.token_ids, out.logprobs, out.finish_reason, out.prompt_len) == ([5, 2], [-0.5, -0.1], "eos", 3)
    assert out.versions == [4, 4]  # vLLM reports no versions: the one current at the request, for every token
    stopped = {"token_ids": [7], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "stop", "stop_reason": "</a>"}
    assert parse_choice(stopped, 1, 0).finish_reason == "stop"
    assert parse_choice(stopped | {"finish_reason": "length"}, 1, 0).finish_reason == "length"
    assert parse_choice(stopped | {"token_versions": [5]}, 1, 4).versions == [5]  # agent-r1 serve's own
    with pytest.raises(RemoteEngineError, match="1 token ids but 0 log-probs"):
        parse_choice(stopped | {"logprobs": None}, 1, 0)
    with pytest.raises(RemoteEngineError, match="1 token ids but 2 token versions"):
        parse_choice(stopped | {"token_versions": [4, 5]}, 1, 4)


# --- weight sync --------------------------------------------------------------------------------------


def tiny(tokenizer, seed: int, hidden: int = 64):
    """A tiny Llama with a random final norm gain: with tied embeddings and unit gains, a random tiny
    Llama greedily repeats the prompt's last token whatever its seed, so two seeds would agree."""
    model = make_tiny_llama(
        len(tokenizer), hidden=hidden, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=seed
    )
    with torch.no_grad():
        model.model.norm.weight.normal_(0.0, 3.0)
    return model


def tiny_lora(tokenizer, seed: int):
    """A tiny Llama wrapped in peft LoRA whose adapters really change it (lora_B is random, not 0)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny(tokenizer, seed), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def greedy(engine, prompt: list[int], n: int = 8):
    (out,) = asyncio.run(engine.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0)))
    return out


@pytest.fixture
def tiny_server(tokenizer):
    """`agent-r1 serve`'s app on loopback (uvicorn in a thread) serving tiny model A: (url, its engine)."""
    engine = LocalEngine(tiny(tokenizer, seed=0), tokenizer, max_context=1024)
    with serving(
        create_app(
            ServedModel(engine, tokenizer, ChatFormat(tokenizer), "tiny-a", engine.eos_ids, allow_weight_updates=True)
        )
    ) as url:
        yield url, engine


@pytest.fixture
def prompt(tokenizer):
    return tokenizer.encode("Once upon a time, in a land far away")


def test_sync_weights_makes_the_server_sample_from_the_trainers_model(tiny_server, tokenizer, prompt, tmp_path):
    url, served = tiny_server
    model_b = tiny(tokenizer, seed=5)
    want = greedy(LocalEngine(model_b, tokenizer), prompt)
    remote = RemoteEngine(url, sync_dir=str(tmp_path))
    assert greedy(remote, prompt).token_ids != want.token_ids  # A and B really differ
    remote.sync_weights(model_b)
    got = greedy(remote, prompt)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["weights_version"] == remote.weights_version == 1
    # written through a rename; the tied lm_head is written under both names (vLLM reloads a layer only
    # from its own name) and stays tied on the server
    assert os.listdir(tmp_path / "weights") == ["model.safetensors"]
    with safe_open(tmp_path / "weights" / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight"))
    assert served.model.lm_head.weight.data_ptr() == served.model.model.embed_tokens.weight.data_ptr()
    remote.sync_weights(model_b)
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["weights_version"] == 2


def test_sync_weights_of_a_lora_model_serves_the_merged_policy(tiny_server, tokenizer, prompt, tmp_path):
    url, _ = tiny_server
    policy = tiny_lora(tokenizer, seed=7)
    local = LocalEngine(policy, tokenizer)
    want = greedy(local, prompt)
    with policy.disable_adapter():
        assert greedy(local, prompt).token_ids != want.token_ids  # the adapters matter
    remote = RemoteEngine(url, sync_dir=str(tmp_path))
    remote.sync_weights(policy)
    got = greedy(remote, prompt)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)  # merged vs unmerged: fp32 rounding


def test_full_state_dict_of_a_lora_model_has_the_plain_names_and_leaves_the_policy_alone(tokenizer):
    policy = tiny_lora(tokenizer, seed=7)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    got = full_state_dict(policy)
    assert set(got) == set(tiny(tokenizer, seed=7).state_dict())  # no adapter or base_layer names
    assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()  # still tied
    after = policy.state_dict()  # the trainer's model is untouched: same weights, nothing left merged
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(getattr(m, "merged", False) for m in policy.modules())


def test_sync_weights_errors_name_the_problem(tiny_server, tokenizer, tmp_path):
    url, _ = tiny_server
    with pytest.raises(ValueError, match="weight sync needs sync_dir"):
        RemoteEngine(url).sync_weights(tiny(tokenizer, seed=5))
    narrow = tiny(tokenizer, seed=5, hidden=32)
    engine = RemoteEngine(url, sync_dir=str(tmp_path))
    refused = r"refused the weights \(400\): .*tensor '(model.embed_tokens|lm_head).weight' has shape \[49152, 32\]"
    with pytest.raises(RemoteEngineError, match=refused):
        engine.sync_weights(narrow)
    assert engine.weights_version == 0
    assert len(greedy(engine, tokenizer.encode("Still there?")).token_ids) == 8  # the server keeps serving


def test_local_engine_sync_weights(tokenizer, prompt):
    model = tiny(tokenizer, seed=0)
    engine = LocalEngine(model, tokenizer)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    engine.sync_weights(model)  # the trainer's own model: nothing to copy, but a new version
    assert all(p is q and torch.equal(p, b) for p, q, b in zip(model.parameters(), params, before, strict=True))
    assert engine.weights_version == 1
    engine.sync_weights(model, version=7)  # the trainer's version (RL steps done), as the producer gives it
    assert engine.weights_version == 7 and greedy(engine, prompt).versions == [7] * len(greedy(engine, prompt).versions)

    other = tiny(tokenizer, seed=5)
    want = greedy(LocalEngine(other, tokenizer), prompt)
    assert greedy(engine, prompt).token_ids != want.token_ids
    engine.sync_weights(other)
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))  # copied in place
    assert greedy(engine, prompt).token_ids == want.token_ids

    policy = tiny_lora(tokenizer, seed=7)  # a LoRA policy into an engine serving the plain model: merged
    engine.sync_weights(policy)
    assert greedy(engine, prompt).token_ids == greedy(LocalEngine(policy, tokenizer), prompt).token_ids


# --- partial rollouts: load_weights(..., between_tokens=True) -------------------------------------------


def test_a_response_in_flight_during_a_between_tokens_load_spans_both_versions(
    tiny_server, tokenizer, prompt, tmp_path
):
    url, served = tiny_server
    remote = RemoteEngine(url, sync_dir=str(tmp_path))
    assert remote.load_weights(full_state_dict(tiny(tokenizer, seed=5)), version=1) > 0  # synced: versions checked
    long = SamplingParams(max_new_tokens=400, temperature=1.0, seed=0)  # a random tiny model rarely samples EOS
    with ThreadPoolExecutor(1) as pool:
        steps = served.stats["decode_steps"]
        running = pool.submit(asyncio.run, remote.generate([prompt], long))
        while served.stats["decode_steps"] < steps + 5 and not running.done():  # the request is decoding
            time.sleep(0.001)
        remote.load_weights(full_state_dict(tiny(tokenizer, seed=6)), version=2, between_tokens=True)
        (out,) = running.result(timeout=60)  # no error: the served version changed, but to one this engine pushed
    old, new = out.versions.count(1), out.versions.count(2)
    assert out.versions == [1] * old + [2] * new and old >= 5 and new > 0, (old, new, out.finish_reason)
    assert remote.weights_version == served.weights_version == 2


def test_with_partial_rollouts_a_version_this_engine_never_pushed_is_still_an_error(
    tiny_server, tokenizer, prompt, tmp_path
):
    url, _ = tiny_server
    remote = RemoteEngine(url, sync_dir=str(tmp_path))
    remote.load_weights(full_state_dict(tiny(tokenizer, seed=5)), version=1, between_tokens=True)
    assert greedy(remote, prompt).versions == [1] * 8
    other = tmp_path / "other.safetensors"
    os.replace(tmp_path / "weights" / "model.safetensors", other)
    httpx.post(f"{url}/v1/load_weights", json={"path": str(other), "version": 7}).raise_for_status()  # someone else
    with pytest.raises(RemoteEngineError, match="serves weights version 7, not 1 "):
        greedy(remote, prompt)
    with pytest.raises(ValueError, match="weights version 1 is not newer than 1"):
        remote.load_weights(full_state_dict(tiny(tokenizer, seed=5)), version=1)


class FakeVLLM:
    """A `vllm serve` in dev mode as RemoteEngine sees it (vLLM 0.32's RL endpoints), recording calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []  # (path, query parameters)
        self.version: str | None = None
        self.on_update = lambda: None  # runs while /update_weight_version is in flight

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((path, dict(request.url.params)))
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "owned_by": "vllm", "max_model_len": 64}]})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version})
        if path == "/v1/completions":
            choice = {"text": "ab", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-1.0, -2.0]}}
            return httpx.Response(200, json={"choices": [choice | {"finish_reason": "length"}]})
        if path == "/update_weight_version":
            self.version = json.loads(request.content)["new_version"]
            self.on_update()
        return httpx.Response(200, json={})


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """(a RemoteEngine talking to a FakeVLLM, the fake)."""
    fake = FakeVLLM()
    with httpx.Client(transport=httpx.MockTransport(fake)) as sync:
        monkeypatch.setattr(httpx, "get", sync.get)
        monkeypatch.setattr(httpx, "post", sync.post)
        engine = RemoteEngine("http://vllm.test", sync_dir=str(tmp_path))
        transport = httpx.MockTransport(fake)
        monkeypatch.setattr(engine, "_client", lambda: httpx.AsyncClient(base_url=engine.base_url, transport=transport))
        yield engine, fake


def test_vllm_pauses_with_mode_keep_for_a_between_tokens_load_and_mode_wait_otherwise(fake_vllm):
    engine, fake = fake_vllm
    assert engine.is_vllm
    state = {"w": torch.ones(2)}
    load = ["/pause", "/collective_rpc", "/update_weight_version", "/resume"]

    def posted() -> list[tuple[str, dict]]:  # the weight sync's calls, generation's left out
        return [(p, q) for p, q in fake.calls if p in load]

    assert engine.load_weights(state) == 1
    assert [p for p, _ in posted()] == load and posted()[0][1] == {"mode": "wait", "clear_cache": "true"}
    fake.calls.clear()
    during: list = []  # the producer's generate ends while the trainer's load is in flight: the server
    # already serves version 2, the engine's weights_version is still 1
    fake.on_update = lambda: during.append(asyncio.run(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))))
    engine.load_weights(state, between_tokens=True)
    assert [p for p, _ in posted()] == load and posted()[0][1] == {"mode": "keep", "clear_cache": "true"}
    assert during[0][0].versions == [1, 1]  # vLLM reports none: the version current at the request, conservative
    assert asyncio.run(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2)))[0].versions == [2, 2]
    fake.version = "99"  # another client's weights
    with pytest.raises(RemoteEngineError, match="serves weights version 99, not 2 "):
        asyncio.run(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2)))
