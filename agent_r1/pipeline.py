"""`agent-r1 demo`: the main job. Untrained eval -> SFT cold start -> RL -> eval, on one held-out set.

Every phase is an ordinary entry point (eval, sft, train) with its own config section. The same
held-out tasks and the same decoding are used before and after, so the table compares like with like.
The run directory ends up holding sft/, rl/ (with the trained checkpoint and policy/), the three eval
trajectory files, curves.png and results.json.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from agent_r1.evaluate import EvalConfig, run_eval
from agent_r1.observe.plot import plot_metrics
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.rl import train
from agent_r1.trainer.sft import SFTConfig, sft
from agent_r1.utils.malloc import release_memory


@dataclass
class DemoConfig:
    run_dir: str = "runs/demo"
    """root of the whole pipeline's outputs"""
    model: str = "default"
    """the starting model (bundled name or Hugging Face directory)"""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """cold-start SFT (model and run_dir are set by the pipeline)"""
    rl: TrainConfig = field(default_factory=TrainConfig)
    """RL from the SFT policy (model and run_dir are set by the pipeline)"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """held-out evaluation used before SFT, after SFT and after RL (model and out are set)"""


def run_demo(cfg: DemoConfig, console: Console | None = None) -> dict[str, dict[str, float]]:
    console = console or Console()
    root = Path(cfg.run_dir)
    if root.exists() and any(root.iterdir()):  # keep an earlier demo run instead of overwriting it
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(root.stat().st_mtime))
        kept = next(
            p for i in range(1000) if not (p := root.with_name(f"{root.name}-{stamp}{f'-{i}' if i else ''}")).exists()
        )
        root.rename(kept)
        console.print(f"kept the previous run as {kept}")
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    timings: dict[str, float] = {}

    def evaluate(name: str, model: str) -> None:
        t0 = time.perf_counter()
        ecfg = dataclasses.replace(cfg.eval, model=model, out=str(root / f"eval_{name}.jsonl"))
        results[name], _ = run_eval(ecfg, console)
        release_memory()
        timings[f"eval_{name}"] = time.perf_counter() - t0

    console.rule("1/4 untrained model")
    evaluate("untrained", cfg.model)

    console.rule("2/4 SFT cold start")
    t0 = time.perf_counter()
    sft(dataclasses.replace(cfg.sft, model=cfg.model, run_dir=str(root / "sft")), console=console)
    release_memory()  # each phase starts from what the process needs, not from the last one's peak
    timings["sft"] = time.perf_counter() - t0
    evaluate("sft", str(root / "sft" / "policy"))

    console.rule("3/4 RL")
    t0 = time.perf_counter()
    history = train(
        dataclasses.replace(cfg.rl, model=str(root / "sft" / "policy"), run_dir=str(root / "rl")), console=console
    )
    release_memory()
    timings["rl"] = time.perf_counter() - t0

    best_file = root / "rl" / "policy" / "best.json"  # written when RL validates and keeps its best step
    selected = json.loads(best_file.read_text()) if best_file.is_file() else None
    if selected:
        metric = cfg.rl.val.metric
        value = selected[metric]
        console.print(f"RL kept step {selected['step']} of {cfg.rl.steps}: the best validation {metric}, {value:.3g}")

    console.rule("4/4 trained model")
    evaluate("rl", str(root / "rl" / "policy"))

    title = f"RL from the SFT checkpoint (training batches at T = {cfg.rl.rollout.temperature})"
    plot_metrics(history, root / "curves.png", title=title)
    summary = {"results": results, "seconds": timings, "rl_selected": selected}
    (root / "results.json").write_text(json.dumps(summary, indent=1))
    print_results(console, results)
    console.print(f"curves: {root / 'curves.png'}   trained policy: {root / 'rl' / 'policy'}")
    return results


def results_table(results: dict[str, dict[str, float]]) -> Table:
    """The demo's results, whole: no cell is cut (a log file is an 80-column console); two-word headers
    take two lines. `print_results` falls back to plain lines where even that does not fit."""
    table = Table(title="held-out accuracy: before / after SFT / after RL")
    kinds = sorted({k for m in results.values() for k in m if k.startswith("accuracy/")})  # e.g. accuracy/ops=2
    per_kind_columns = [k.removeprefix("accuracy/") for k in kinds]
    for col in ("model", "accuracy", *per_kind_columns, "tool\ncalls", "format\nerrors", "turns"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, row in _result_rows(results, kinds):
        table.add_row(name, *row)
    return table


def print_results(console: Console, results: dict[str, dict[str, float]]) -> None:
    """The results table, or, on a console too narrow for it, each model's results one per line."""
    table = results_table(results)
    if Measurement.get(console, console.options.update_width(10**4), table).maximum <= console.width:  # uncut
        console.print(table)
        return
    kinds = sorted({k for m in results.values() for k in m if k.startswith("accuracy/")})
    heads = ["accuracy", *(k.removeprefix("accuracy/") for k in kinds), "tool calls", "format errors", "turns"]
    console.print("held-out accuracy: before / after SFT / after RL")
    for name, row in _result_rows(results, kinds):
        console.print(f"{name}:")
        for head, value in zip(heads, row, strict=True):
            console.print(f"  {head} {value}")


def _result_rows(results: dict[str, dict[str, float]], kinds: list[str]) -> list[tuple[str, list[str]]]:
    rows = []
    for name, m in results.items():
        per_kind = [f"{m[k]:.1%}" if k in m else "" for k in kinds]
        usage = [f"{m['tool_calls']:.2f}", f"{m['format_errors']:.2f}", f"{m['turns']:.2f}"]
        rows.append((name, [f"{m['accuracy']:.1%}", *per_kind, *usage]))
    return rows
