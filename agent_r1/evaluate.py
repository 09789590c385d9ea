"""`agent-r1 eval`: roll a model out on a task set and report accuracy and tool use.

Reads top to bottom: load model -> build env + engine -> roll out every task -> aggregate -> report.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from rich.console import Console
from rich.table import Table
from scipy import stats

from agent_r1.config import to_dict
from agent_r1.data import Split
from agent_r1.engines import EngineKind, EngineSpec, VLLMConfig, load_for_engine, make_engine
from agent_r1.engines.protocol import Engine, SamplingParams
from agent_r1.env.base import Env
from agent_r1.env.tool_formats import ToolFormatName
from agent_r1.models.loading import load_processor
from agent_r1.models.precision import Device, Precision
from agent_r1.observe.health import OVERFLOW_REMEDY
from agent_r1.observe.records import trajectory_from_record, trajectory_records, write_records
from agent_r1.rollout.agent_loop import AgentEnvLoop, correct, summarize
from agent_r1.task import TaskSpec, resolve_chat, resolve_tool_format
from agent_r1.types import Termination, Trajectory
from agent_r1.utils.progress import progress_bar

ERROR_WARNING = 0.5  # above this share of errored episodes, the accuracy says nothing about the model


@dataclass
class EvalConfig:
    model: str = "default"
    """"default", a bundled model (smollm2-135m-instruct, gemma3-270m) or a Hugging Face directory"""
    device: Device = "auto"
    """where the model runs: auto = cuda when a GPU is visible, else cpu"""
    dtype: Precision = "fp32"
    """weights and compute in fp32, or in bf16 (a GPU choice: half the memory)"""
    task: TaskSpec = field(default_factory=TaskSpec)
    """calculator, gsm8k, hotpotqa, or an import path (my_pkg.my_task); its options: task.KEY=VALUE"""
    split: Split = "test"
    """the task's split: test (held out), val (what training validates on) or train"""
    num_tasks: int = 32
    """how many tasks to evaluate (the first N of the split)"""
    group_size: int = 1
    """samples per task"""
    max_turns: int = 4
    """turn budget per episode"""
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    """chat template or plain text; auto = chat when the model has a template"""
    tool_format: ToolFormatName = "auto"
    """how the model writes tool calls: auto = its chat template's family (hermes, llama3_json, mistral,
    mistral_args, qwen3_coder, harmony); hermes for a model without a template"""
    temperature: float = 0.0
    """0 = greedy"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    max_new_tokens: int = 96
    """sampled tokens per turn"""
    engine: EngineKind = "local"
    """what samples: local (the model in this process), vllm (vLLM in this process), or remote (an
    OpenAI-compatible server that speaks token ids at url: agent-r1 serve, vllm serve; model then names
    the tokenizer, which must be the server's model's)"""
    url: str = ""
    """engine=remote: the server's base URL (http://host:port)"""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """engine=vllm: vLLM's own settings"""
    max_batch_size: int = 64
    """rows decoded together by the engine"""
    kv_cache_gb: float = 4.0
    """memory for keys and values, running rows and those kept between turns: too little for every
    episode's context makes the engine prefill evicted contexts again (long multi-turn evals); at most
    half the memory free at start-up"""
    kv_cache_dtype: Literal["auto", "bf16"] = "auto"
    """keys and values as the model computes them (auto), or stored in bf16 for an fp32 model: twice the
    tokens in kv_cache_gb and, on the CPU, fewer bytes for each decode step to read, at bf16's rounding"""
    seed: int = 0
    """sampling seed"""
    out: str | None = None
    """write trajectory records here (.jsonl, or .jsonl.gz; `agent-r1 view OUT` browses them); while eval
    runs, each finished episode's is kept in OUT's name with .partial.jsonl, which the full file replaces"""
    resume: bool = False
    """finish an eval that was killed: the tasks whose episodes OUT's .partial.jsonl holds are not run
    again and count in the results; run it with the same settings"""

    def __post_init__(self) -> None:
        if self.num_tasks < 1 or self.group_size < 1:
            raise ValueError("num_tasks and group_size must be >= 1")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        self.engine_spec()  # an unknown engine, or remote without url: one line now
        _ = self.sampling  # validates temperature, top_p and max_new_tokens before any model loads

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)

    def engine_spec(self) -> EngineSpec:
        return EngineSpec(
            self.engine, self.url, self.max_batch_size, self.kv_cache_gb, seed=self.seed, dtype=self.dtype,
            kv_cache_bf16=self.kv_cache_dtype == "bf16", vllm=self.vllm,
        )  # fmt: skip


def run_eval(cfg: EvalConfig, console: Console | None = None) -> tuple[dict[str, float], list[Trajectory]]:
    console = console or Console()
    if cfg.resume and not cfg.out:
        raise ValueError("resume=true needs out=, the file whose .partial.jsonl an earlier eval left")
    tasks = cfg.task.tasks(cfg.split, cfg.num_tasks, cfg.seed)  # a bad data file fails before the model loads
    if not tasks:
        raise ValueError(f"task {cfg.task.name!r} has no {cfg.split} tasks")
    settings = eval_settings(cfg)
    kept = partial_path(cfg.out) if cfg.out else None
    finished = finished_episodes(kept, tasks, settings, cfg.resume, console) if kept else {}
    model, tokenizer = load_for_engine(cfg.engine, cfg.model, cfg.device, cfg.dtype)
    processor = load_processor(cfg.model) or tokenizer  # a vision-language model reads images through it
    make_env = cfg.task.env_factory(
        processor,
        resolve_chat(cfg.prompt_format, processor, cfg.model),
        cfg.max_turns,
        resolve_tool_format(cfg.tool_format, cfg.model),
    )
    make_env.check_context(tasks[0])
    engine = make_engine(cfg.engine_spec(), model, tokenizer)
    records = {r["traj_id"]: r for group in finished.values() for r in group}  # traj_id -> its record
    if kept is not None:  # the partial file starts with the finished groups alone
        write_records(kept, list(records.values()))
    with progress_bar(console) as bar, open(kept, "a", encoding="utf-8") if kept else contextlib.nullcontext() as f:
        episodes = bar.add_task(f"eval {cfg.task.name}", total=len(tasks) * cfg.group_size, completed=len(records))

        def done(traj: Trajectory, sample: int) -> None:
            bar.advance(episodes)
            if f is not None:  # a long eval killed midway keeps the episodes it finished
                record = trajectory_records([traj], tokenizer)[0] | {"eval": {"sample": sample, "settings": settings}}
                records[traj.traj_id] = record
                f.write(json.dumps(record, default=str) + "\n")
                f.flush()

        done_trajs = {i: [trajectory_from_record(r) for r in group] for i, group in finished.items()}
        try:
            metrics, trajs = evaluate(
                engine, make_env, tasks, cfg.sampling, cfg.group_size, cfg.seed, cfg.task.kind_key, done, done_trajs
            )
        finally:
            engine.close()  # vLLM's workers and a remote engine's connections end with the eval
    if cfg.out:  # the viewer reads these: agent-r1 view OUT
        write_records(cfg.out, [records[t.traj_id] for t in trajs])
        kept.unlink(missing_ok=True)
    console.print(report_table(cfg.model, metrics))
    if note := overflow_note(trajs, engine.max_context):
        console.print(f"[bold red]warning:[/] {note}")
    if metrics["errors"] > ERROR_WARNING:
        console.print(
            f"[bold red]warning: {metrics['errors']:.0%} of the episodes ended in an error, so the accuracy "
            f"measures the errors, not the model.[/] First error: {next(t.error for t in trajs if t.error)}"
        )
    return metrics, trajs


def overflow_note(trajs: Sequence[Trajectory], max_context: int) -> str | None:
    """How many episodes ended because the prompt outgrew the context window, how many of them before the
    model's first turn, and the remedy: without it such an eval reads "turns 0.00, accuracy 0.0%"."""
    cut = [t for t in trajs if t.termination == Termination.CONTEXT_OVERFLOW]
    if not cut:
        return None
    first = sum(not t.steps for t in cut)
    return (
        f"{len(cut)} of {len(trajs)} episodes ended in a context overflow ({first} before the model's first turn: "
        f"the prompt alone outgrew its {max_context:,}-token context). {OVERFLOW_REMEDY}"
    )


def partial_path(out: str | Path) -> Path:
    """Where eval keeps each finished episode's record as it goes (`runs/x.jsonl` -> `runs/x.partial.jsonl`),
    until the whole file, in task order, replaces it: a kill an hour into a τ² eval loses nothing finished.
    `agent-r1 view` and `benchmarks/paired_eval.py` read it like any record file."""
    out = Path(out)
    return out.with_name(re.sub(r"\.jsonl(\.gz)?$", "", out.name) + ".partial.jsonl")


RESUME_KEYS = ("model", "engine", "dtype", "task", "split", "num_tasks", "group_size", "max_turns", "prompt_format",
               "tool_format", "temperature", "top_p", "max_new_tokens", "kv_cache_dtype", "seed")  # fmt: skip
"""The settings that decide which episodes an eval samples: a resumed eval must share them."""
ADDED_SETTINGS = {"kv_cache_dtype": "auto", "engine": "local"}
"""Resume keys added since evals first kept settings, with the value every earlier eval ran with."""


def eval_settings(cfg: EvalConfig) -> dict[str, Any]:
    """The settings an eval record keeps (JSON as it reads back), which `resume=true` checks."""
    everything = to_dict(cfg)
    return json.loads(json.dumps({k: everything[k] for k in RESUME_KEYS}, default=str))


def finished_episodes(
    kept: Path, tasks: list[dict[str, Any]], settings: dict[str, Any], resume: bool, console: Console | None = None
) -> dict[int, list[dict[str, Any]]]:
    """{task position: its records, in sample order} of the tasks whose every sample a killed eval left in
    `kept`. Each record names its sample (task position × group_size + g) and the settings that made it.

    A task whose group the kill cut short is run again whole (its samples are seeded as before). Without
    `resume` a file holding any episode is refused rather than overwritten: it may hold an hour of work;
    so is a file made with other settings, or whose tasks differ from this eval's (changed data)."""
    if not kept.is_file():
        return {}
    lines, records = kept.read_text(encoding="utf-8").splitlines(), []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # only the last line can be cut short by a kill (its episode is run again)
                break
            record = None
        made = record.get("eval") if isinstance(record, dict) else None
        sample = made.get("sample") if isinstance(made, dict) else None
        if not (isinstance(sample, int) and sample >= 0 and "task" in record):
            raise ValueError(f"{kept}:{n}: not a record of agent-r1 eval; delete the file to start over")
        # a record from before a key was added ran with its default
        theirs = {k: ADDED_SETTINGS[k] for k in ADDED_SETTINGS.keys() & settings.keys()} | (made.get("settings") or {})
        if theirs != settings:
            changed = [f"{k}={theirs.get(k)!r}" for k in settings if theirs.get(k) != settings[k]]
            raise ValueError(
                f"{kept}:{n}: made by an eval with {', '.join(changed) or 'other settings'}; resume with those "
                "settings, or delete the file to start over"
            )
        records.append(record)
    if not records:
        return {}
    if not resume:
        raise ValueError(
            f"{kept} holds {len(records)} finished episodes of an earlier eval: resume=true finishes that eval "
            "(same settings), or delete the file to start over"
        )
    group_size = settings["group_size"]
    by_position: dict[int, dict[int, dict[str, Any]]] = {}  # task position -> {g: record}
    for record in records:
        position, g = divmod(record["eval"]["sample"], group_size)
        if position >= len(tasks) or _task_key(record["task"]) != _task_key(tasks[position]):
            raise ValueError(
                f"{kept}: task {position} is not the one this eval reads there (its data changed); delete the "
                "file to start over"
            )
        by_position.setdefault(position, {})[g] = record
    whole = {p: group for p, group in by_position.items() if len(group) == group_size}
    finished = {p: [group[g] for g in range(group_size)] for p, group in whole.items()}
    cut = sum(len(group) for p, group in by_position.items() if p not in finished)
    if console is not None:
        console.print(
            f"resumed: {len(finished)} of {len(tasks)} tasks finished in {kept}"
            + (f"; {cut} episodes of groups the kill cut short run again" if cut else "")
        )
    return finished


def _task_key(task: dict[str, Any]) -> str:
    """A task as it reads back from a record (JSON, keys sorted)."""
    return json.dumps(task, sort_keys=True, default=str)


def evaluate(
    engine: Engine, make_env: Callable[[], Env], tasks: list[dict[str, Any]], sampling: SamplingParams,
    group_size: int = 1, seed: int = 0, kind_key: str | None = None,
    on_done: Callable[[Trajectory, int], None] | None = None, finished: dict[int, list[Trajectory]] | None = None,
) -> tuple[dict[str, float], list[Trajectory]]:  # fmt: skip
    """Roll every task out `group_size` times; summary metrics plus `accuracy`, `episodes`, `errors`
    (the share that ended in an exception) and `seconds` (of this call). `on_done(traj, sample)` is called
    as each episode ends (sample: task position × group_size + g). `finished[i]` are task i's episodes
    from an earlier run: they are not run again (the rest are seeded as in one whole run), and they count
    in the metrics.

    Accuracy is the share of episodes that solved their task (`agent_loop.correct`)."""
    start = time.perf_counter()
    finished = finished or {}
    todo = [i for i in range(len(tasks)) if i not in finished]
    loop = AgentEnvLoop(engine, make_env, sampling, seed=seed)
    new = loop.run_sync([tasks[i] for i in todo], group_size, on_done=on_done, positions=todo) if todo else []
    ran = dict(zip(todo, (new[k : k + group_size] for k in range(0, len(new), group_size)), strict=True))
    trajs = [t for i in range(len(tasks)) for t in (finished[i] if i in finished else ran[i])]
    metrics = summarize(trajs)
    metrics["seconds"] = time.perf_counter() - start
    metrics["accuracy"] = sum(map(correct, trajs)) / len(trajs)
    metrics["episodes"] = float(len(trajs))
    metrics["errors"] = sum(t.termination == Termination.ERROR for t in trajs) / len(trajs)
    return metrics | accuracy_by_kind(trajs, kind_key), trajs


def bootstrap_ci(
    values: Sequence[float], baseline: Sequence[float] | None = None, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` over tasks, or with `baseline` the mean paired difference
    values - baseline (the same tasks, in order), with a percentile bootstrap interval over tasks
    (Efron & Tibshirani 1993; `scipy.stats.bootstrap`, 10,000 resamples). Resampling the per-task
    differences keeps the pairing, so an interval that excludes 0 is a difference between the two
    models, not between two draws of questions."""
    x = np.asarray(values, dtype=np.float64)  # [N]
    if baseline is not None:
        b = np.asarray(baseline, dtype=np.float64)
        if b.shape != x.shape:
            raise ValueError(f"bootstrap_ci: {x.size} values but {b.size} baseline values (pair them by task)")
        x = x - b
    if x.size < 2:
        raise ValueError(f"bootstrap_ci needs at least 2 tasks, got {x.size}")
    if np.all(x == x[0]):  # every resample has the same mean
        return float(x[0]), float(x[0]), float(x[0])
    ci = stats.bootstrap((x,), np.mean, confidence_level=confidence, method="percentile", rng=seed).confidence_interval
    return float(x.mean()), float(ci.low), float(ci.high)


def accuracy_by_kind(trajs: list[Trajectory], key: str | None) -> dict[str, float]:
    """`accuracy/<key>=<value>` per kind of task, when every task names one: the calculator's `ops`
    (1-3 operations) or HotpotQA's `type` (bridge, comparison). One mean hides which kind moved."""
    if key is None or not trajs or not all(key in t.task for t in trajs):
        return {}
    hits: dict[str, list[float]] = {}
    for t in trajs:
        hits.setdefault(f"accuracy/{key}={t.task[key]}", []).append(correct(t))
    return {k: sum(v) / len(v) for k, v in sorted(hits.items())}


def report_table(title: str, m: dict[str, float]) -> Table:
    """Episodes, errors, accuracy (per kind too), tool use and turns, then every logged reward part (EM, F1,
    format, ...): one row per metric, so that the table reads at any terminal width."""
    parts = sorted(k for k in m if k.startswith("reward/") and k != "reward/correct")
    columns = {
        "episodes": f"{m['episodes']:.0f}",
        "errors": f"{m['errors']:.0%}",
        "accuracy": f"{m['accuracy']:.1%}",
        "tool calls / episode": f"{m['tool_calls']:.2f}",
        "format errors / episode": f"{m['format_errors']:.2f}",
        "tool errors / episode": f"{m['tool_errors']:.2f}",
        "turns": f"{m['turns']:.2f}",
        **{k.removeprefix("accuracy/"): f"{m[k]:.1%}" for k in sorted(m) if k.startswith("accuracy/")},
        **{k.removeprefix("reward/"): f"{m[k]:.3f}" for k in parts},
        "seconds": f"{m['seconds']:.1f}",
    }
    table = Table("metric", "value", title=f"eval: {title}")
    for name, value in columns.items():
        table.add_row(name, value)
    return table
