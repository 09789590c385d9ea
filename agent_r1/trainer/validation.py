"""Validation during RL and best-checkpoint selection.

Model selection on a split that is neither trained on nor reported (as in HF Trainer's
`load_best_model_at_end`): RL curves are noisy and a policy can overshoot, e.g. learn a rule that helps
the training mix and hurts another problem type, so the run keeps the step that validated best instead
of whatever the last step happens to be. The held-out test split stays untouched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from agent_r1.engines.protocol import Engine, SamplingParams
from agent_r1.env.base import Env
from agent_r1.evaluate import evaluate
from agent_r1.observe.records import step_path, trajectory_records, write_records
from agent_r1.trainer.checkpoint import export_policy
from agent_r1.trainer.config import TrainConfig
from agent_r1.utils.malloc import release_memory

BEST_FILE = "best.json"


class Validator:
    """Greedy evaluation of the validation tasks; the best policy so far (by `metric`) is exported to
    `out` with `best.json` beside it, in one atomic rename."""

    def __init__(
        self,
        tasks: list[dict[str, Any]],
        make_env: Callable[[], Env],
        engine: Engine,
        policy,
        tokenizer,
        *,
        metric: str,
        max_new_tokens: int,
        out: Path | None,
        records: Path | None,
        info: dict[str, Any],
        console: Console,
        kind_key: str | None = None,
        own_engine: bool = False,
    ) -> None:
        """`own_engine`: the engine validates only (the rollout has one of its own): it takes the policy's
        weights before each validation and gives its memory back after it."""
        self.tasks, self.make_env, self.engine = tasks, make_env, engine
        self.policy, self.tokenizer, self.console = policy, tokenizer, console
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        self.metric, self.out, self.records, self.info, self.kind_key = metric, out, records, info, kind_key
        self.best: dict[str, float] = {"step": -1, metric: -math.inf}
        self.own_engine = own_engine

    def restore(self, checkpoint_best: dict[str, float] | None) -> None:
        """After a resume: the best so far is what policy/ holds (its best.json, written with it), else
        the checkpoint's record; so the exported policy and the best step never disagree."""
        exported = self.out / BEST_FILE if self.out is not None else None
        best = json.loads(exported.read_text()) if exported is not None and exported.is_file() else checkpoint_best
        if best and self.metric in best:  # the same metric as the saved best
            self.best = best

    def __call__(self, step: int) -> dict[str, float]:
        """Validate the current policy (after `step` RL steps); export it if it is the best so far."""
        self.policy.eval()
        release_memory()  # the update's freed heap (0.4 GB in the demo) before the validation's keys
        if self.own_engine:  # over the policy itself: it drops the keys computed with older weights
            self.engine.sync_weights(self.policy, step)
        metrics, trajs = evaluate(self.engine, self.make_env, self.tasks, self.sampling, 1, 0, self.kind_key)
        if self.own_engine:
            self.engine.sleep()  # its memory goes to the update (the rollout's engine keeps its keys)
        if self.records is not None:
            write_records(step_path(self.records, step), trajectory_records(trajs, self.tokenizer, step=step))
        m = self.metric
        if m not in metrics:
            raise ValueError(f"val.metric={m!r} is not an eval metric; choose from {', '.join(sorted(metrics))}")
        value = metrics[m]
        if value > self.best[m]:
            self.best = {"step": step, m: value}
            if self.out is not None:
                extra = {BEST_FILE: json.dumps(self.best)}
                export_policy(self.policy, self.tokenizer, self.out, info=self.info | {"step": step}, extra=extra)
        self.console.print(
            f"validation after step {step}: {m} {value:.3g} (best {self.best[m]:.3g} at step {self.best['step']})"
        )
        if step == 0 and self.out is not None and m.startswith("accuracy") and value >= 1:
            self.console.print(
                f"[yellow]validation: the starting policy already scores {m} 1 on the {len(self.tasks)} validation "
                "tasks, and a tie keeps the earlier step, so no RL step can replace it in policy/: raise "
                "val.num_tasks, or set val.keep_best=false to export the last step[/yellow]"
            )
        return {f"val/{k}": v for k, v in metrics.items()} | {"val/best_step": self.best["step"]}


def make_validator(
    cfg: TrainConfig,
    engine: Engine,
    make_env,
    policy,
    tokenizer,
    chat: bool,
    info: dict[str, Any],
    console: Console,
    own_engine: bool = False,
) -> Validator | None:
    """Validation on the task's val split (its options changed by `val.task`), or None when off; the
    env is `make_env` when the trainer was given one, else the task's own."""
    v = cfg.val
    if not v.every:
        return None
    spec = cfg.task.with_options(v.task, prefix="val.task.")
    return Validator(
        spec.tasks("val", v.num_tasks, cfg.seed),
        make_env or spec.env_factory(tokenizer, chat, cfg.rollout.max_turns, info["tool_call_format"]["name"]),
        engine, policy, tokenizer, metric=v.metric, max_new_tokens=cfg.rollout.max_new_tokens,
        out=Path(cfg.run_dir) / "policy" if v.keep_best else None,
        records=Path(cfg.run_dir) / "val" if cfg.log.trajectories_every else None,  # agent-r1 view RUN_DIR/val
        info=info, console=console, kind_key=spec.kind_key, own_engine=own_engine,
    )  # fmt: skip
