"""task=openenv: options, splits, the local server's lifecycle, and `agent-r1 eval` on a real OpenEnv server
with one command line and no code."""

from __future__ import annotations

import json
import sys

import pytest

from agent_r1.config import build
from agent_r1.task import load_task
from agent_r1.tasks import openenv as oe
from agent_r1.utils import servers

pytest.importorskip("openenv.core", reason="the envs extra (pip install -e .[envs]) brings openenv-core")
GUESS = "examples.openenv_guess:app"


def options(**kw) -> oe.Options:
    return build(oe.Options, kw, prefix="task.")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "needs exactly one of task.url .* or task.app"),
        ({"url": "http://h:1", "app": GUESS}, "needs exactly one of"),
        ({"url": "localhost:8000"}, "task.url must start with http://"),
        ({"app": "examples.openenv_guess"}, "task.app must be pkg.module:app"),
        ({"app": "no_such_pkg.server:app"}, "no module 'no_such_pkg.server' importable from here"),
        ({"url": "http://h:1", "tool_name": "make move"}, "task.tool_name 'make move' must match"),
        ({"url": "http://h:1", "timeout_s": 0}, "task.timeout_s must be > 0"),
        ({"url": "http://h:1", "max_observation_tokens": 0}, "task.max_observation_tokens must be >= 1"),
    ],
)
def test_bad_options_are_one_line_errors(raw, message):
    with pytest.raises(ValueError, match=message) as err:
        options(**raw)
    assert "\n" not in str(err.value)


def test_it_is_a_built_in_task_and_a_missing_package_is_one_line_with_the_install(monkeypatch):
    assert load_task("openenv") is oe
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)
    with pytest.raises(ImportError, match=r"needs openenv-core: pip install openenv-core==0\.3\.0"):
        options(url="http://127.0.0.1:1")


def test_seeds_are_split_by_hash_bucket_and_data_rows_are_reset_arguments(tmp_path):
    o = options(url="http://127.0.0.1:1")
    splits = {s: oe.tasks(o, s, 50) for s in ("train", "val", "test")}
    seeds = {s: {t["seed"] for t in ts} for s, ts in splits.items()}
    assert all(len(v) == 50 for v in seeds.values())
    assert not (seeds["train"] & seeds["val"] or seeds["train"] & seeds["test"] or seeds["val"] & seeds["test"])
    assert oe.tasks(o, "test", 50) == splits["test"] and oe.tasks(o, "test", 50, seed=1) != splits["test"]
    rows = [{"seed": 5, "difficulty": "hard"}, {"seed": 6}]
    data = tmp_path / "resets.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert oe.tasks(options(url="http://127.0.0.1:1", data=str(data)), "test", 5) == rows


def test_an_app_that_cannot_start_is_one_line_with_what_it_printed(tmp_path, monkeypatch):
    (tmp_path / "broken_env.py").write_text("raise SystemExit('the env needs a GPU it does not have')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="app broken_env:app exited at start: the env needs a GPU it") as err:
        oe.local_server("broken_env:app")
    assert "\n" not in str(err.value)


def test_a_local_server_is_started_once_per_process_and_again_after_it_dies():
    import httpx

    url = oe.local_server(GUESS)
    try:
        assert oe.local_server(GUESS) == url  # the same server for every episode
        proc, _ = servers._SERVERS[GUESS]
        proc.kill()
        proc.wait()
        again = oe.local_server(GUESS)
        assert httpx.get(f"{again}/health").json() == {"status": "healthy"}
    finally:
        oe.stop_local_servers()
    assert proc.poll() is not None and not servers._SERVERS


def test_a_local_server_starts_off_the_event_loop_so_other_episodes_go_on(monkeypatch, tokenizer):
    """Restarting a server that died takes seconds: done in `make_env` (on the rollout's event loop), it
    stalled every other episode of the loop for that long."""
    import asyncio
    import time

    from agent_r1.env.prompt_format import ChatFormat

    def slow_start(app):
        time.sleep(0.5)
        return "http://127.0.0.1:1"  # nothing listens: reset then fails, as a server that did not come up

    monkeypatch.setattr(oe, "local_server", slow_start)

    async def episode_beside_a_ticker():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        beside = asyncio.create_task(ticker())
        start = time.monotonic()
        env = oe.make_env(options(app=GUESS), ChatFormat(tokenizer))
        made = time.monotonic() - start
        with pytest.raises(oe.EnvServerError, match=r"127\.0\.0\.1:1"):
            await env.reset({"seed": 1})
        beside.cancel()
        return made, ticks

    made, ticks = asyncio.run(episode_beside_a_ticker())
    assert made < 0.1 and ticks >= 20  # the loop ran on while the server started


def test_eval_runs_an_openenv_server_from_one_command_line(tiny_model_dir, tokenizer):
    """`agent-r1 eval task=openenv task.app=...`: the server starts, every episode is a session, none
    errors (the random tiny model rarely calls the tool; a turn without a call ends its episode)."""
    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, run_eval

    overrides = [f"model={tiny_model_dir}", "task=openenv", f"task.app={GUESS}", "num_tasks=4", "max_new_tokens=8"]
    try:
        metrics, trajs = run_eval(load_config(EvalConfig, None, overrides))
    finally:
        oe.stop_local_servers()
    assert metrics["episodes"] == 4.0 and metrics["errors"] == 0.0
    assert all(t.error is None for t in trajs)
    seeds = [t.task["seed"] for t in trajs]
    assert seeds == [t["seed"] for t in oe.tasks(options(app=GUESS), "test", 4)]
    prompt = tokenizer.decode(trajs[0].steps[0].prompt_ids)  # the reset observation, with the action's tool
    assert "I am thinking of a number from 1 to 100" in prompt and '"name": "act"' in prompt
