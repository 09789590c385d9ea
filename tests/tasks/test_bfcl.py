"""task=bfcl: options, items interleaved across categories, BFCL's venv, and `agent-r1 eval` on BFCL from
one command line."""

from __future__ import annotations

import subprocess

import pytest

from agent_r1.config import build
from agent_r1.task import load_task
from agent_r1.tasks import bfcl
from agent_r1.tasks import bfcl as bfcl_env


def options(**kw) -> bfcl.Options:
    return build(bfcl.Options, kw, prefix="task.")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"categories": ["simple_java"]}, "BFCL has no category 'simple_java' here; valid: simple_python, multiple"),
        ({"categories": []}, "task.categories is empty"),
    ],
)
def test_bad_options_are_one_line_errors(raw, message):
    with pytest.raises(ValueError, match=message) as err:
        options(**raw)
    assert "\n" not in str(err.value)


def test_items_interleave_categories_and_are_the_same_for_every_split():
    assert load_task("bfcl") is bfcl and options(categories=["simple"]).categories == ["simple_python"]
    o = options(categories=["simple_python", "multi_turn_base"])
    items = bfcl.tasks(o, "test", 5)
    assert [t["id"] for t in items] == [
        "simple_python_0", "multi_turn_base_0", "simple_python_1", "multi_turn_base_1", "simple_python_2",
    ]  # fmt: skip
    assert bfcl.tasks(o, "train", 5) == items
    assert len(bfcl.tasks(options(categories=["parallel"]), "test", 10_000)) == 200  # BFCL's parallel items


def test_a_venv_that_cannot_be_made_is_one_line_with_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_R1_CACHE", str(tmp_path))

    def offline(*args, **kwargs):
        raise subprocess.CalledProcessError(1, args[0])

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(
        RuntimeError, match=r"make it with: python -m venv .*bfcl-2026\.3\.23 && .* --no-deps bfcl-eval"
    ):
        bfcl_env.bfcl_python()
    with pytest.raises(ValueError, match=r"task\.python '/no/python' does not exist"):
        bfcl_env.bfcl_python("/no/python")


def test_eval_runs_bfcl_from_one_command_line(tiny_model_dir):
    """`agent-r1 eval task=bfcl ...`: AST and multi-turn items at once, none errored, accuracy per category."""
    from agent_r1.config import load_config
    from agent_r1.evaluate import EvalConfig, run_eval

    overrides = [f"model={tiny_model_dir}", "task=bfcl", "task.categories=[simple_python,parallel,multi_turn_base]"]
    metrics, _ = run_eval(load_config(EvalConfig, None, [*overrides, "num_tasks=6", "max_new_tokens=8"]))
    assert metrics["episodes"] == 6.0 and metrics["errors"] == 0.0
    assert {
        "accuracy/category=simple_python",
        "accuracy/category=parallel",
        "accuracy/category=multi_turn_base",
    } <= set(metrics)
