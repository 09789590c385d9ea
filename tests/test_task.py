"""Tasks as plugins: found by name or import path, typed options, a picklable env factory, and a task
that lives outside the package (examples/shop_task.py) trained through the CLI."""

import asyncio
import json
import pickle
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest

from agent_r1.cli import main
from agent_r1.config import ConfigError, load_config
from agent_r1.evaluate import EvalConfig
from agent_r1.task import EnvFactory, TaskSpec, load_task
from agent_r1.tasks import calculator


def first_prompt(factory: EnvFactory, task: dict) -> list[int]:
    """Build the env from the factory (in whatever process runs this) and return its first prompt ids."""
    return asyncio.run(factory().reset(task)).token_ids


def test_env_factory_is_picklable_and_builds_the_same_env_in_another_process(tokenizer):
    spec = TaskSpec("examples.shop_task")
    factory = spec.env_factory(tokenizer, chat=True, max_turns=3)
    task = spec.tasks("train", 1)[0]
    assert first_prompt(pickle.loads(pickle.dumps(factory)), task) == first_prompt(factory, task)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:  # a fresh interpreter, as Ray uses
        remote = pool.submit(first_prompt, factory, task).result(timeout=120)
    assert remote == first_prompt(factory, task) and "price" in tokenizer.decode(remote)


def test_task_options_are_typed_and_checked_under_the_task_key():
    cfg = load_config(EvalConfig, None, ["task=calculator", "task.ops=[1,3]", "task.format_weight=1"])
    assert cfg.task.options == calculator.Options(ops=(1, 3), format_weight=1.0)
    cfg = load_config(EvalConfig, None, ["task.ops=[2]", "task=calculator"])  # any order
    assert cfg.task.options.ops == (2,)
    cfg = load_config(EvalConfig, None, ["task=examples.shop_task", "task.items=3"])
    assert cfg.task.options.items == 3 and len(cfg.task.tasks("test", 2)[0]["items"]) == 3
    for overrides, message in [
        (["task.opps=[1]"], "unknown config key 'task.opps'; did you mean 'task.ops'?"),
        (["task.ops=many"], "config key 'task.ops' must be"),
        (["task.ops=[4]"], "task.ops must be operation counts in 1..3"),
        (["task=gsm8k", "task.ops=[1]"], "unknown config key 'task.ops'"),  # gsm8k has no ops
        (["task=no.such.module"], "task 'no.such.module' cannot be imported"),
        (["task=json"], "task 'json' lacks Options, tasks, make_env"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(EvalConfig, None, overrides)


def test_a_task_can_be_a_file_and_its_env_factory_still_ships(tmp_path, tokenizer, monkeypatch):
    import sys

    path = tmp_path / "my_task.py"
    path.write_text(Path(load_task("examples.shop_task").__file__).read_text())
    monkeypatch.chdir(tmp_path)
    spec = load_config(EvalConfig, None, ["task=my_task.py", "task.items=3"]).task
    assert spec.name == str(path) and spec.tasks("train", 2) == TaskSpec("examples.shop_task").with_options(
        {"items": 3}
    ).tasks("train", 2)
    factory = spec.env_factory(tokenizer, chat=True, max_turns=2)
    task = spec.tasks("train", 1)[0]
    blob = pickle.dumps(factory)
    module = type(spec.options).__module__
    monkeypatch.delitem(sys.modules, module)  # what a fresh process has: no module of that name
    restored = pickle.loads(blob)
    assert restored.options.items == 3 and first_prompt(restored, task) == first_prompt(factory, task)


def test_the_example_task_trains_through_the_cli_with_no_edit_to_the_package(tmp_path, tokenizer, tiny_model_dir):
    """examples/shop_task.py (under 80 lines: two tools, a custom reward) trains for 2 steps on a tiny model."""
    from agent_r1.observe.records import read_records, step_files

    assert len(Path(load_task("examples.shop_task").__file__).read_text().splitlines()) < 80
    run = tmp_path / "run"
    args = [
        "train", f"model={tiny_model_dir}", f"run_dir={run}", "task=examples.shop_task", "task.penalty=0.5", "steps=2",
        "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_turns=2",
        "algo.zero_variance_groups=keep",
    ]  # fmt: skip
    assert main(args) == 0
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["updates"] == 1 for m in steps)
    records = list(read_records(step_files(run)[2]))
    assert len(records) == 4 and all("reward/looked_up" in r["metrics"] for r in records)
    # a random model never looks prices up: every reward carries the task's own penalty
    assert all(r["reward"] == pytest.approx(r["metrics"]["reward/correct"] - 0.5) for r in records)
    assert "price" in tokenizer.decode(records[0]["rows"][0]["ids"])  # the task's tools are in the prompt
    info = json.loads((run / "policy/agent_r1.json").read_text())
    assert info["task"] == {"name": "examples.shop_task", "items": 2, "penalty": 0.5}
    assert info["prompt_format"] == "chat"


def test_a_task_import_path_resolves_from_the_working_directory():
    """The `agent-r1` script does not put the working directory on sys.path; task names still resolve
    from it, as `python -m` would (run isolated, -I, so the interpreter adds nothing itself)."""
    import subprocess
    import sys

    code = "from agent_r1.task import load_task; print(load_task('examples.shop_task').PRICES['apple'])"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.4"


def test_the_mcp_example_offers_a_real_servers_tools_and_evaluates_through_the_cli(tmp_path, tokenizer, tiny_model_dir):
    """examples/mcp_task.py: any MCP server's tools (here the SDK-built test server over stdio) next to the
    python sandbox, from the command line; an episode that uses them earns the reward."""
    import sys

    from agent_r1.engines.protocol import SamplingParams
    from agent_r1.env.prompt_format import ChatFormat
    from agent_r1.rollout.agent_loop import AgentEnvLoop
    from tests.rollout.test_agent_loop import ScriptedEngine

    data = tmp_path / "qa.jsonl"
    data.write_text(
        '{"question": "What is 20 + 22?", "answer": 42}\n{"question": "Capital of France?", "answer": "Paris"}\n'
    )
    server = f"{sys.executable} {Path(__file__).parent / 'tools' / 'mcp_server.py'} stdio"
    options = [f"task.server={server}", f"task.data={data}"]
    spec = load_config(EvalConfig, None, ["task=examples/mcp_task.py", *options]).task
    module = spec.module
    env = module.make_env(spec.options, ChatFormat(tokenizer))
    assert {"add", "pid", "python"} <= set(env.tools) and '"name": "add"' in env.system

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "<answer>42</answer>"])
    loop = AgentEnvLoop(engine, lambda: module.make_env(spec.options, ChatFormat(tokenizer)), SamplingParams())
    (traj,) = loop.run_sync(spec.tasks("test", 1))
    assert traj.reward == 1.0 and traj.steps[0].info["tool_results"][0]["output"] == "42"
    assert module.reward({"answer": "Paris"}, "<answer>paris</answer>") == 1.0

    out = tmp_path / "eval.jsonl"
    args = ["eval", f"model={tiny_model_dir}", "task=examples/mcp_task.py", *options, "num_tasks=2",
            "max_new_tokens=4", f"out={out}"]  # fmt: skip
    assert main(args) == 0 and len(out.read_text().splitlines()) == 2
    with pytest.raises(ConfigError, match=r"exactly one of task\.server"):
        load_config(EvalConfig, None, ["task=examples/mcp_task.py", f"task.data={data}"])
    for server in module._SERVERS.values():  # the server process would otherwise live as long as pytest
        server.close()
    module._SERVERS.clear()


def test_task_context_on_an_env_that_cannot_manage_one_is_one_line(tokenizer):
    """`digits` answers in one step and has no ToolEnv: asking it to manage a context is refused, naming it."""
    spec = TaskSpec.from_raw({"name": "digits", "context": {"strategy": "truncate", "budget": 512}}, "task", TaskSpec())
    with pytest.raises(ValueError, match=r"task\.context needs an env that manages its context") as err:
        spec.env_factory(tokenizer, True, 4)()
    assert "'digits'" in str(err.value) and "\n" not in str(err.value)
