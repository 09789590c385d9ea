"""RemoteEngine against a real `agent-r1 serve` process on loopback: the same rollouts as LocalEngine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.models import load_model
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.engine import SamplingParams
from agent_r1.rollout.local_engine import LocalEngine
from agent_r1.rollout.remote_engine import RemoteEngine, RemoteEngineError, parse_choice
from agent_r1.tools import calculator
from tests.conftest import TOOL_QUESTION, recompute_logprobs

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
    out = parse_choice(old_vllm, prompt_len=3)
    assert (out.token_ids, out.logprobs, out.finish_reason, out.prompt_len) == ([5, 2], [-0.5, -0.1], "eos", 3)
    stopped = {"token_ids": [7], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "stop", "stop_reason": "</a>"}
    assert parse_choice(stopped, 1).finish_reason == "stop"
    assert parse_choice(stopped | {"finish_reason": "length"}, 1).finish_reason == "length"
    with pytest.raises(RemoteEngineError, match="1 token ids but 0 log-probs"):
        parse_choice(stopped | {"logprobs": None}, 1)
