"""RL through the gateway: `train()` with the gateway's env factory and an OpenAI-SDK agent program, for two
steps in lockstep (the program as a command) and asynchronously (`rollout.max_staleness=1`, the program as a
function), and `task=gateway` as a config section."""

from __future__ import annotations

import json
import pickle

import pytest
from transformers import AutoModelForCausalLM

from agent_r1.config import ConfigError, load_config
from agent_r1.gateway import ProgramEnv, ProgramEnvFactory
from agent_r1.task import TaskSpec
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.rl import train
from agent_r1.types import Termination
from tests.gateway.test_env import AGENT, TASK
from tests.trainer.conftest import toy_config


def reward(task, episode, output) -> float:
    """1 when the program printed (a command) or returned (a function) the answer; by import path from the factory."""
    return float(str(task["answer"]) in (output.stdout or str(output.value)))


@pytest.mark.parametrize(
    ("program", "staleness"),
    [
        ({"command": AGENT}, 0),
        ({"function": "tests.gateway.sdk_agent:run"}, 1),
        ({"function": "tests.gateway.sdk_agent:run_forced"}, 0),
    ],
    ids=["lockstep-command", "async-function", "forced-call"],
)
def test_two_rl_steps_through_the_gateway(tmp_path, tokenizer, tool_model_dir, program, staleness):
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir)
    factory = ProgramEnvFactory(tokenizer, reward="tests.gateway.test_train:reward", max_turns=3, **program)
    factory = pickle.loads(pickle.dumps(factory))  # what Ray workers get
    cfg = toy_config(
        tmp_path, "steps=2", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=40",
        "optim.lr=1e-4", "algo.zero_variance_groups=keep", f"rollout.max_staleness={staleness}",
    )  # fmt: skip
    hist = train(cfg, model=model, tokenizer=tokenizer, make_env=factory, tasks=[TASK] * 4)
    assert len(hist) == 2
    for h in hist:
        assert h["updates"] >= 1 and h["trained_episodes"] == 4 and h[f"termination/{Termination.ERROR}"] == 0
        assert h["reward_mean"] > 0 and h["tool_calls"] > 0  # the model's calls, which the program ran
        # the program re-sends its history as it got it: every later request extends the prompt (one row)
        assert h["gateway/merged_steps"] > 0 and h["gateway/fresh_steps"] == 0.0
        # fp32 noise of the overfit tool model's peaked logits under oneDNN: ToolEnv's rollouts of this model
        # drift the same 1.05e-4, to the digit; a token the gateway misplaced would be off by whole nats
        assert h["logprob_drift_max"] < 2e-4
        # a forced first call is sampled under the grammar, and the update's log-probs are under its mask too
        assert h.get("constrained_steps", 0.0) == (1.0 if "forced" in str(program) else 0.0)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["gateway/merged_steps"] for m in logged] == [h["gateway/merged_steps"] for h in hist]


def test_task_gateway_is_a_config_section(tmp_path, tokenizer):
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps(TASK) + "\n")
    spec = TaskSpec.from_raw(
        {"name": "gateway", "command": list(AGENT), "reward": "tests.gateway.test_train:reward", "data": str(data)},
        "task",
        TaskSpec(),
    )
    assert spec.tasks("train", 8) == [TASK]
    env = pickle.loads(pickle.dumps(spec.env_factory(tokenizer, True, 3)))()
    assert isinstance(env, ProgramEnv) and env.max_turns == 3 and env.program == list(AGENT)
    with pytest.raises(ConfigError, match=r"did you mean 'task\.timeout_s'"):
        load_config(TrainConfig, None, ["task=gateway", "task.timeout=3"])
    with pytest.raises(ConfigError, match=r"task\.reward=.*cannot be imported"):
        load_config(TrainConfig, None, ["task=gateway", "task.reward=no_such_module:score"])
