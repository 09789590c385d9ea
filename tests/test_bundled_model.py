"""The real bundled model, end to end on calculator tasks (slow: ~1 min on 2 cores)."""

import pytest
import torch

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.models import load_model
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.merge import merge_trajectories
from agent_r1.tasks import calculator
from agent_r1.types import Termination
from tests.conftest import recompute_logprobs


@pytest.mark.slow
def test_bundled_model_on_eight_calculator_tasks():
    model, tokenizer = load_model("default")
    engine = LocalEngine(model, tokenizer, seed=0)
    loop = AgentEnvLoop(
        engine,
        lambda: calculator.make_env(calculator.Options(), ChatFormat(tokenizer), max_turns=3),
        SamplingParams(max_new_tokens=48, temperature=1.0),
        seed=0,
    )
    tasks = calculator.make_tasks(8, split="test")
    trajs = loop.run_sync(tasks, group_size=1)
    assert len(trajs) == 8
    assert all(t.termination in (Termination.ANSWERED, Termination.MAX_TURNS) for t in trajs)
    assert all(t.steps and all(s.response_ids for s in t.steps) for t in trajs)
    metrics = summarize(trajs)
    assert 0.0 <= metrics["reward"] <= 1.0 and metrics["turns"] >= 1.0
    # the guard rail on the real model: rollout log-probs == training forward log-probs
    for row in merge_trajectories(trajs):
        ref = recompute_logprobs(model, row.input_ids)
        mask = torch.tensor(row.loss_mask[1:], dtype=torch.bool)
        assert (ref[mask] - torch.tensor(row.logprobs[1:])[mask]).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_the_vision_demo_model_is_token_exact_with_pictures_in_every_turn():
    """The guard rail on the vision demo's real model (SmolLM2-135M + its SigLIP tower, built once): an
    image in the first observation and another in each tool result; the rollout's log-probs equal the
    model's own forward and the trainer's, within 1e-4 in fp32."""
    from agent_r1.models.loading import load_processor
    from agent_r1.models.vision import image_token_id
    from agent_r1.trainer.batching import pack
    from agent_r1.trainer.rows import build_rows
    from tests.rollout.test_vision_rollout import reference, rollout, trainer_gap

    model, _ = load_model("smollm2-135m-llava")
    processor = load_processor("smollm2-135m-llava")
    _, trajs = rollout(model, processor, [{"seed": 1}, {"seed": 2}])
    assert all(len(t.steps) == 3 and len(t.steps[-1].images) == 3 for t in trajs), [t.error for t in trajs]
    seqs = [merge_trajectories([t]) for t in trajs]
    for (row,) in seqs:
        mask = torch.tensor(row.loss_mask[1:], dtype=torch.bool)
        ref = reference(model, row.input_ids, row.images)
        assert (ref[mask] - torch.tensor(row.logprobs[1:])[mask]).abs().max().item() <= 1e-4
    rows, _ = build_rows(trajs, seqs, image_token_id(model))
    assert trainer_gap(model, pack(rows, 4096)) <= 1e-4


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


@pytest.mark.slow
async def test_the_bundled_model_served_keeps_the_structure_the_api_promises():
    """Asked with a named tool_choice, the bundled model alone wrote the tool's schema back into the arguments
    until max_tokens, and the raw `<tool_call>` markup came back as content; sampled under the grammar, it
    returns the call with arguments the schema accepts. `response_format: json_schema` likewise."""
    import json

    import httpx
    import jsonschema

    from agent_r1.serve import ServedModel, create_app

    model, tokenizer = load_model("default")
    engine = LocalEngine(model, tokenizer, seed=0, max_context=2048)
    served = ServedModel(engine, tokenizer, ChatFormat(tokenizer), "policy", engine.eos_ids, request_timeout=120.0)
    ask = {"model": "policy", "messages": [{"role": "user", "content": "What's the weather in Paris?"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(served)), base_url="http://t") as http:
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            body = ask | {"tools": [WEATHER], "tool_choice": choice, "max_tokens": 120, "temperature": 0}
            reply = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
            assert reply["finish_reason"] == "tool_calls" and reply["message"]["content"] is None
            (call,) = reply["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}  # fmt: skip
        body = ask | {
            "messages": [{"role": "user", "content": "Give me a person named Ann aged 30 as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": person}},
            "max_tokens": 60, "temperature": 0,
        }  # fmt: skip
        reply = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert reply["finish_reason"] == "stop"
        jsonschema.validate(json.loads(reply["message"]["content"]), person)
    engine.close()
