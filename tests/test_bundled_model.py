"""The real bundled model, end to end on calculator tasks (slow: ~1 min on 2 cores)."""

import pytest
import torch

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.models import load_model
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.engine import SamplingParams
from agent_r1.rollout.local_engine import LocalEngine
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
