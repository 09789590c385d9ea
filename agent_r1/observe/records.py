"""Trajectory records: what a run keeps of every episode, for people and for analysis.

A record is one JSON object per trajectory: the task, each turn as a person reads it (new context,
response, tool calls and results, reward, advantage) and the training rows exactly as the trainer saw
them (token ids, the decoded piece of every token, loss mask, rollout log-probs, advantages). Steps
are written as `trajectories/step_000001.jsonl.gz` in the run directory (see docs/observability.md);
`agent-r1 eval out=...` writes the same records, so the viewer reads both.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_r1.rollout.merge import extends, merge_trajectory
from agent_r1.types import Step, Termination, TrainSequence, Trajectory

if TYPE_CHECKING:  # the viewer reads records without torch, which takes seconds to import
    import torch

TRAJECTORY_DIR = "trajectories"
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl\.gz$")


def trajectory_records(
    trajs: Sequence[Trajectory],
    tokenizer: Any,
    *,
    step: int | None = None,
    sequences: Sequence[Sequence[TrainSequence]] | None = None,
    advantages: Sequence[Sequence[torch.Tensor] | None] | None = None,
    ref_logprobs: Sequence[Sequence[torch.Tensor | None] | None] | None = None,
) -> list[dict[str, Any]]:
    """One record per trajectory. `sequences[i]` are its training rows as the trainer merged them (merged
    here when not given) and `advantages[i][j]` ([T]) belongs to row j, so token ids, masks and
    advantages line up exactly; `advantages[i]` is None for an episode that was not trained on."""
    out = []
    for i, traj in enumerate(trajs):
        rows = sequences[i] if sequences is not None else merge_trajectory(traj)
        advs = (advantages[i] if advantages is not None else None) or [None] * len(rows)
        refs = (ref_logprobs[i] if ref_logprobs is not None else None) or [None] * len(rows)
        row_records = [_row_record(r, a, ref, tokenizer) for r, a, ref in zip(rows, advs, refs, strict=True)]
        out.append(
            {
                "step": step,
                "traj_id": traj.traj_id,
                "group_id": traj.group_id,
                "task": traj.task,
                "termination": str(traj.termination) if traj.termination is not None else None,
                "reward": traj.reward,
                "error": traj.error,
                "metrics": traj.metrics,
                "turns": _turns(traj, row_records, tokenizer),
                "rows": row_records,
            }
        )
    return out


def _row_record(seq, adv: torch.Tensor | None, ref: torch.Tensor | None, tokenizer: Any) -> dict[str, Any]:
    return {
        "ids": seq.input_ids,
        "tokens": tokenizer.batch_decode([[t] for t in seq.input_ids]),  # one decoded piece per id
        "mask": seq.loss_mask,
        "logprobs": [round(x, 6) for x in seq.logprobs],
        "advantages": None if adv is None else [round(float(x), 6) for x in adv.tolist()],
        "ref_logprobs": None if ref is None else [round(float(x), 6) for x in ref.tolist()],
        "step_index": seq.step_index,
    }


def _turns(traj: Trajectory, rows: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """Each step as a person reads it: what entered the context since the last response, then the response.

    When the env rewrote the context (the prompt does not extend the previous one) the whole prompt is
    shown and `rewritten` is set."""
    from agent_r1.models.vision import png_data_url  # imports torch: only where records are written

    step_adv = _step_advantages(rows)
    turns, context, shown = [], None, 0
    for s in traj.steps:
        appended = context is not None and extends(s.prompt_ids, context)
        new = s.prompt_ids[len(context) :] if appended else s.prompt_ids
        new_images = s.images[shown:] if appended else s.images  # the pictures that entered with `new`
        info = {k: v for k, v in s.info.items() if k != "tool_results"}
        turns.append(
            {
                "index": s.index,
                "observation": tokenizer.decode(new),
                "images": [png_data_url(i.picture, max_side=256) for i in new_images if i.picture is not None],
                "rewritten": context is not None and not appended,
                "response": s.text,
                "finish_reason": s.finish_reason,
                "response_tokens": len(s.response_ids),
                "grammar": s.grammar,
                "reward": s.reward,
                "done": s.done,
                "advantage": step_adv.get(s.index),
                "tool_results": s.info.get("tool_results", []),
                "info": json.loads(json.dumps(info, default=str)),
            }
        )
        context, shown = s.prompt_ids + s.response_ids, len(s.images)
    return turns


def trajectory_from_record(record: dict[str, Any]) -> Trajectory:
    """The trajectory a record was made from, as its metrics and training rows need it: each step's exact
    prompt and response ids and log-probs (to the record's 6 decimals) come from its row, where step k's
    prompt is the row up to k's first sampled token (a step that sampled no token, such as one cut by the
    context, keeps no ids); reward, text, info and `done` from its turn. Images and states are not kept
    in records. A resumed eval (`agent-r1 eval resume=true`) counts the episodes a killed run finished
    through this."""
    termination = record["termination"]
    traj = Trajectory(
        task=record["task"],
        traj_id=record["traj_id"],
        group_id=record["group_id"],
        termination=None if termination is None else Termination(termination),
        metrics=record["metrics"],
        error=record["error"],
    )
    where: dict[int, tuple[dict[str, Any], list[int]]] = {}  # step index -> (its row, its token positions)
    for row in record["rows"]:
        for pos, k in enumerate(row["step_index"]):
            if k >= 0:
                where.setdefault(k, (row, []))[1].append(pos)
    for turn in record["turns"]:
        row, positions = where.get(turn["index"], ({"ids": [], "logprobs": []}, []))  # no token sampled: no ids
        info = turn["info"] | ({"tool_results": turn["tool_results"]} if turn["tool_results"] else {})
        traj.steps.append(
            Step(
                prompt_ids=row["ids"][: positions[0]] if positions else [],
                response_ids=[row["ids"][i] for i in positions],
                response_logprobs=[row["logprobs"][i] for i in positions],
                reward=turn["reward"],
                info=info,
                text=turn["response"],
                index=turn["index"],
                finish_reason=turn["finish_reason"],
                done=turn["done"],
                grammar=turn.get("grammar"),
            )
        )
    return traj


def _step_advantages(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Advantage of each step: the value on its first sampled token (step-level estimators broadcast it)."""
    out: dict[int, float] = {}
    for r in rows:
        if r["advantages"] is None:
            continue
        for k, adv in zip(r["step_index"], r["advantages"], strict=True):
            if k >= 0 and k not in out:
                out[k] = adv
    return out


def write_records(path: str | Path, records: list[dict[str, Any]]) -> Path:
    """Write records as JSONL (gzip when the name ends in .gz), atomically: a kill leaves no half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(tmp, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")
    os.replace(tmp, path)
    return path


def step_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / TRAJECTORY_DIR / f"step_{step:06d}.jsonl.gz"


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of one file (.jsonl or .jsonl.gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON record ({exc.msg})") from None


def step_files(run_dir: str | Path) -> dict[int, Path]:
    """{step: file} of a run directory's trajectory files, in step order."""
    found = {}
    for p in (Path(run_dir) / TRAJECTORY_DIR).glob("step_*.jsonl.gz"):
        if m := _STEP_FILE.search(p.name):
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))
