"""`agent-r1 eval`: roll a model out on a task set and report accuracy and tool use.

Reads top to bottom: load model -> build env + engine -> roll out every task -> aggregate -> report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rich.console import Console
from rich.table import Table

from agent_r1.data import Split, load_tasks
from agent_r1.env.base import Env
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.models.loading import is_chat_model, load_model
from agent_r1.observe.records import trajectory_records, write_records
from agent_r1.recipes import Recipe, tasks_and_env
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.engine import Engine, SamplingParams
from agent_r1.rollout.local_engine import LocalEngine
from agent_r1.types import Trajectory

KIND_KEYS = ("ops", "type")  # task fields that name a kind of problem, for a per-kind accuracy


@dataclass
class EvalConfig:
    model: str = "default"
    """"default", a bundled model (smollm2-135m-instruct, gemma3-270m) or a Hugging Face directory"""
    recipe: Recipe = "calculator"
    """task, tools and reward: calculator (synthetic word problems), gsm8k, or hotpotqa (search)"""
    data: str | None = None
    """jsonl of tasks with question/answer; None = the recipe's own tasks of `split`"""
    split: Split = "test"
    """the recipe's split: test (held out), val (what training validates on) or train"""
    num_tasks: int = 32
    """how many tasks to evaluate (the first N of the data)"""
    ops: tuple[int, ...] = (1, 2)
    """operations per generated problem (difficulty levels 1-3), cycled"""
    retriever: str = "bm25"
    """hotpotqa recipe: search index, bm25 or dense, or the URL of an `agent-r1 retrieval-server`"""
    max_tool_tokens: int = 256
    """hotpotqa recipe: each search result is cut to this many tokens"""
    group_size: int = 1
    """samples per task"""
    max_turns: int = 4
    """turn budget per episode"""
    few_shot: bool = True
    """show one worked tool-use episode before the question"""
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    """chat template or plain text; auto = chat when the model has a template"""
    temperature: float = 0.0
    """0 = greedy"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    max_new_tokens: int = 96
    """sampled tokens per turn"""
    max_batch_size: int = 64
    """rows decoded together by the engine"""
    seed: int = 0
    """sampling seed"""
    out: str | None = None
    """write trajectory records here (.jsonl, or .jsonl.gz; `agent-r1 view OUT` browses them)"""

    def __post_init__(self) -> None:
        if self.num_tasks < 1 or self.group_size < 1:
            raise ValueError("num_tasks and group_size must be >= 1")
        if any(o not in (1, 2, 3) for o in self.ops):
            raise ValueError(f"ops must be in 1..3, got {self.ops}")
        _ = self.sampling  # validates temperature, top_p and max_new_tokens before any model loads

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)


def run_eval(cfg: EvalConfig, console: Console | None = None) -> tuple[dict[str, float], list[Trajectory]]:
    console = console or Console()
    if cfg.data:
        load_tasks(cfg.data)  # a bad data file fails before the model loads
    model, tokenizer = load_model(cfg.model)
    chat = is_chat_model(cfg.model, tokenizer) if cfg.prompt_format == "auto" else cfg.prompt_format == "chat"
    fmt = prompt_format_for(tokenizer, chat=chat)
    tasks, make_env = tasks_and_env(
        cfg.recipe, fmt, split=cfg.split, n=cfg.num_tasks, ops=cfg.ops, data=cfg.data,
        max_turns=cfg.max_turns, few_shot=cfg.few_shot, retriever=cfg.retriever, max_tool_tokens=cfg.max_tool_tokens,
    )  # fmt: skip
    engine = LocalEngine(model, tokenizer, max_batch_size=cfg.max_batch_size, seed=cfg.seed)
    with console.status(f"rolling out {len(tasks)} tasks × {cfg.group_size} on {cfg.model}"):
        metrics, trajs = evaluate(engine, make_env, tasks, cfg.sampling, cfg.group_size, cfg.seed)
    if cfg.out:  # the viewer reads these: agent-r1 view OUT
        write_records(cfg.out, trajectory_records(trajs, tokenizer))
    console.print(report_table(cfg.model, metrics))
    return metrics, trajs


def evaluate(
    engine: Engine, make_env: Callable[[], Env], tasks: list[dict[str, Any]], sampling: SamplingParams,
    group_size: int = 1, seed: int = 0,
) -> tuple[dict[str, float], list[Trajectory]]:  # fmt: skip
    """Roll every task out `group_size` times; summary metrics plus `accuracy` and `seconds`.

    Accuracy is the mean `reward/correct` part when the reward reports one (the format bonus must
    not count), else the share of episodes with reward >= 1."""
    start = time.perf_counter()
    trajs = AgentEnvLoop(engine, make_env, sampling, seed=seed).run_sync(tasks, group_size)
    metrics = summarize(trajs)
    metrics["seconds"] = time.perf_counter() - start
    metrics["accuracy"] = metrics.get("reward/correct", sum(t.reward >= 1.0 for t in trajs) / len(trajs))
    return metrics | accuracy_by_kind(trajs), trajs


def accuracy_by_kind(trajs: list[Trajectory]) -> dict[str, float]:
    """`accuracy/<key>=<value>` per kind of task, when every task names one: the calculator's `ops`
    (1-3 operations) or HotpotQA's `type` (bridge, comparison). One mean hides which kind moved."""
    key = next((k for k in KIND_KEYS if trajs and all(k in t.task for t in trajs)), None)
    if key is None:
        return {}
    hits: dict[str, list[float]] = {}
    for t in trajs:
        correct = t.metrics.get("reward/correct", float(t.reward >= 1.0))
        hits.setdefault(f"accuracy/{key}={t.task[key]}", []).append(correct)
    return {k: sum(v) / len(v) for k, v in sorted(hits.items())}


def report_table(title: str, m: dict[str, float]) -> Table:
    """Accuracy, tool use and turns, then every logged reward part (EM, F1, format, ...)."""
    parts = sorted(k for k in m if k.startswith("reward/") and k != "reward/correct")
    columns = {
        "accuracy": f"{m['accuracy']:.1%}",
        "tool calls / episode": f"{m['tool_calls']:.2f}",
        "format errors / episode": f"{m['format_errors']:.2f}",
        "tool errors / episode": f"{m['tool_errors']:.2f}",
        "turns": f"{m['turns']:.2f}",
        **{k.removeprefix("accuracy/"): f"{m[k]:.1%}" for k in sorted(m) if k.startswith("accuracy/")},
        **{k.removeprefix("reward/"): f"{m[k]:.3f}" for k in parts},
        "seconds": f"{m['seconds']:.1f}",
    }
    table = Table(title=f"eval: {title}")
    for col in columns:
        table.add_column(col, justify="right")
    table.add_row(*columns.values())
    return table
