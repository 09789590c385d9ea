"""Chaos: SIGKILL `agent-r1 train` at random moments, resume after each kill, check nothing was lost.

A tiny random Llama (with SmolLM2's real tokenizer) trains on the calculator task on the CPU,
checkpointing every step. The script first runs it once without interruption, then runs it again in
a second run directory, killing it `--kills` times with SIGKILL and restarting the same command
after each kill (`resume=true` is the default). It checks that

* every resume starts from the newest complete checkpoint, so a kill loses at most the step in
  progress;
* no checkpoint is ever corrupt: after every kill, each `checkpoints/step_N` directory loads into a
  fresh model and optimizer, and a half-written save exists only as a `.tmp-…` directory;
* at the end `metrics.jsonl` holds every step exactly once, and each line equals the uninterrupted
  run's (timings aside);
* every step's trajectory records (token ids, log-probs, advantages) equal the uninterrupted run's,
  but for the random group ids;
* the final policy, and the last checkpoint's weights and AdamW state, equal the uninterrupted run's
  (to 1e-6; on this CPU they are bit-identical).

The trainer has no test hook. Which phase a kill hit is read from the run directory, whose files
appear in a fixed order within step k: the rollout ends when `trajectories/step_k.jsonl.gz` is
written (just before the update), the update ends when step k's line is appended to
`metrics.jsonl`, the checkpoint is written into `checkpoints/.tmp-step_k-…` and published by renaming
it to `step_k`. Each kill waits for the boundary where its target phase starts, then a random share
of that phase's length in the uninterrupted run, and, once the process is dead, the directory says
which phase it was really in.

With `--max-staleness k` the run is asynchronous (rollout.max_staleness=k): the resumed run cannot
equal the uninterrupted one then (which groups make a step depends on timing), so it is checked for
what must still hold, and for every step training whole groups with no task trained twice.

    python benchmarks/chaos_train.py [--kills 20] [--steps 10] [--seed 0] [--out runs/chaos] [--max-staleness 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("rollout", "update", "checkpoint")
POLL_S = 0.001  # the checkpoint of the tiny model is written in tens of milliseconds
VOLATILE = ("time/", "tokens_per_s/")  # metrics that measure the machine, not the run
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_TMP_DIR = re.compile(r"^\.tmp-step_(\d{6,})")
_RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\)")


# --- the run under test ---------------------------------------------------------------------------


def make_model(out: Path) -> Path:
    """A 2-layer Llama over SmolLM2's real tokenizer, saved as a Hugging Face directory. Its weights
    are drawn 50x wider than usual (std 1.0): the default init gives a near-uniform next-token
    distribution, whose entropy gradient is ~0, so the update would change nothing and equal final
    weights would prove nothing. With peaked logits the entropy bonus moves every weight each step."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from agent_r1.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=1.0,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def train_command(model_dir: Path, run_dir: Path, steps: int, seed: int, max_staleness: int = 0) -> list[str]:
    """`agent-r1 train` on the calculator task, a few seconds a run: 2 tasks x 4 samples of <= 24
    tokens per step, a checkpoint every step. The random model never earns a reward, so the groups
    are kept (`zero_variance_groups=keep`) and the entropy bonus is what the update follows. The
    format-collapse health check is set to fire on any trend (2 steps of history), so its flag in
    metrics.jsonl depends on the history a resumed run rebuilds."""
    return [
        sys.executable, "-m", "agent_r1.cli", "train",
        f"model={model_dir}", f"run_dir={run_dir}", f"steps={steps}", f"seed={seed}",
        "device=cpu", "save_every=1", "keep_last=2", "task.few_shot=false",
        "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24", "rollout.max_turns=2",
        "algo.zero_variance_groups=keep", "algo.entropy_coef=0.01", "optim.lr=1e-3",
        "health.window=1", "health.format_error_rise=-1", f"rollout.max_staleness={max_staleness}",
    ]  # fmt: skip


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start the trainer in its own process group (so the kill reaches anything it started), its
    output to `log`; a wide console keeps rich from wrapping the "resumed from" line."""
    env = os.environ | {"COLUMNS": "400", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the trainer's process group (it was started as its leader) and reap it."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def resumed_step(log: Path) -> int:
    """The checkpoint step a launch resumed from, from its own "resumed from … (step N)" line; 0 when
    it started afresh."""
    found = _RESUMED.findall(log.read_text(errors="replace"))
    return int(found[-1]) if found else 0


# --- what the run directory says ------------------------------------------------------------------


class RunDir:
    """The observable state of a run directory; `since_ns` tells this launch's files from older ones."""

    def __init__(self, path: Path, since_ns: int = 0) -> None:
        self.path, self.since_ns = path, since_ns
        self.ckpts = path / "checkpoints"

    def fresh(self, p: Path) -> bool:
        """Written or renamed by this launch (a file of the same name may survive from a killed one)."""
        try:
            return p.stat().st_ctime_ns >= self.since_ns
        except FileNotFoundError:
            return False

    def config_written(self) -> bool:
        """`config.yaml` is rewritten once the checkpoint is loaded: start-up is over."""
        return self.fresh(self.path / "config.yaml")

    def trajectory_written(self, step: int) -> bool:
        """The step's records are written after its rollout, rows and advantages, just before the update."""
        return self.fresh(self.path / "trajectories" / f"step_{step:06d}.jsonl.gz")

    def saved(self, step: int) -> bool:
        return (self.ckpts / f"step_{step:06d}" / "meta.json").is_file()

    def entries(self) -> list[Path]:
        return sorted(self.ckpts.iterdir()) if self.ckpts.is_dir() else []

    def complete(self) -> list[int]:
        """Steps of the checkpoints resume would consider: `step_N` holding meta.json."""
        return sorted(int(d.name[5:]) for d in self.step_dirs() if (d / "meta.json").is_file())

    def step_dirs(self) -> list[Path]:
        return [d for d in self.entries() if _STEP_DIR.match(d.name)]

    def tmp_dirs(self) -> list[Path]:
        return [d for d in self.entries() if d.name.startswith(".tmp-")]

    def writing(self, step: int) -> Path | None:
        """This launch's temporary directory of checkpoint `step`, while it is being written."""
        for d in self.tmp_dirs():
            if (m := _TMP_DIR.match(d.name)) and int(m[1]) == step and self.fresh(d):
                return d
        return None

    def logged(self) -> list[int]:
        """The step of every metrics line; a line that does not parse counts as -1."""
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(int(json.loads(line)["step"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                out.append(-1)
        return out


def phase_of(rd: RunDir, steps: int, keep_last: int = 2) -> tuple[str, int, str]:
    """(phase, step in progress, detail) of a dead trainer, from the files it left."""
    complete = rd.complete()
    done = max(complete, default=0)
    removing = any(d.name.startswith(".tmp-remove-") and rd.fresh(d) for d in rd.tmp_dirs())
    if removing or len(rd.step_dirs()) > keep_last:  # published, the oldest not yet pruned
        return "checkpoint", done, "published, pruning the oldest"
    k = done + 1
    if tmp := rd.writing(k):
        return "checkpoint", k, "writing " + (",".join(sorted(f.name for f in tmp.iterdir())) or "(empty)")
    if not rd.config_written():
        return "startup", k, "loading"
    if k > steps:
        return "export", done, "after the last checkpoint"
    if not rd.trajectory_written(k):
        return "rollout", k, "rollout, rewards, rows"
    if k not in rd.logged():
        return "update", k, "advantages, update, weight sync"
    return "log", k, "logged, checkpoint not started"


def wait_until(cond, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Poll `cond` until it holds. The trainer exiting first is an error: a kill target must lie
    inside the run."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise RuntimeError(f"the trainer exited (rc {proc.returncode}) before the kill target was reached")
        if time.monotonic() > deadline:
            raise TimeoutError("kill target not reached")
        time.sleep(POLL_S)


# --- the uninterrupted run and its timeline -------------------------------------------------------


def timeline(cmd: list[str], run_dir: Path, steps: int, log: Path) -> dict[str, Any]:
    """Run `cmd` to the end while watching its directory; return when each boundary was first seen
    (seconds from launch): start-up over, and per step its records written, its checkpoint's write
    started and the checkpoint published. The checkpoint's length, which the trainer does not time,
    comes from these."""
    rd = RunDir(run_dir, time.time_ns())
    t0 = time.monotonic()
    proc = launch(cmd, log)
    events = [("config", rd.config_written)]
    for k in range(1, steps + 1):
        events += [
            (f"records_{k}", lambda k=k: rd.trajectory_written(k)),
            (f"tmp_{k}", lambda k=k: rd.writing(k) is not None),
            (f"saved_{k}", lambda k=k: rd.saved(k)),
        ]
    seen: dict[str, float] = {}
    while proc.poll() is None:
        # only the next two events, in their order: polling them all would slow the run it measures
        for i, (name, cond) in enumerate(events[:2]):
            if cond():
                seen[name] = time.monotonic() - t0
                del events[: i + 1]  # an event passed over (a write shorter than the poll) stays unseen
                break
        time.sleep(POLL_S)
    if proc.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed (rc {proc.returncode}), see {log}")
    return {"total_s": time.monotonic() - t0, "events": seen}


def phase_lengths(tl: dict[str, Any], metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds from each phase's boundary to its end in the uninterrupted run: rollout and
    update from the trainer's own timers, the checkpoint from the watched directory."""
    e = tl["events"]
    ckpt = [e[f"saved_{k}"] - e[f"tmp_{k}"] for k in range(1, len(metrics) + 1) if f"tmp_{k}" in e]
    return {
        "rollout": statistics.median(m["time/rollout"] + m["time/reference"] for m in metrics),
        "update": statistics.median(m["time/update"] + m["time/weight_sync"] for m in metrics),
        "checkpoint": statistics.median(ckpt or [0.02]),
    }


# --- the kills ------------------------------------------------------------------------------------


@dataclass
class Kill:
    n: int
    target: str
    target_step: int
    delay_s: float
    phase: str = ""
    step: int = 0
    detail: str = ""
    checkpoint_at_kill: int = 0
    logged_at_kill: int = 0
    resumed_from: int | None = None
    corrupt: list[str] = field(default_factory=list)
    tmp_left: int = 0

    @property
    def steps_redone(self) -> int | None:
        """Finished (logged) steps the resumed run had to redo: 0, or 1 for a kill between a step's
        metrics line and its published checkpoint."""
        return None if self.resumed_from is None else max(0, self.logged_at_kill - self.resumed_from)


def boundary(rd: RunDir, target: str, step: int, first: bool):
    """The condition that starts `target` phase of `step`."""
    if target == "rollout":
        return rd.config_written if first else (lambda: rd.saved(step - 1))
    if target == "update":
        return lambda: rd.trajectory_written(step)
    return lambda: rd.writing(step) is not None


@dataclass
class Setup:
    """One run under test: its command, directory, model and length."""

    cmd: list[str]
    run_dir: Path
    model_dir: Path
    steps: int


def kill_once(run: Setup, log: Path, n: int, target: str, step: int, delay_s: float) -> Kill:
    """Launch (a resume), wait for the start of `target` in `step`, wait `delay_s`, SIGKILL, and
    record where the kill really landed, what was on disk and whether every checkpoint loads."""
    rd = RunDir(run.run_dir, time.time_ns())
    first = step == max(rd.complete(), default=0) + 1
    proc = launch(run.cmd, log)
    try:
        wait_until(boundary(rd, target, step, first), proc)
        time.sleep(delay_s)
    finally:
        if proc.poll() is None:
            kill(proc)
    phase, at, detail = phase_of(rd, run.steps)
    k = Kill(n, target, step, delay_s, phase, at, detail)
    k.checkpoint_at_kill = max(rd.complete(), default=0)
    k.logged_at_kill = max(rd.logged(), default=0)
    k.corrupt = check_checkpoints(run.run_dir, run.model_dir)
    k.tmp_left = len(rd.tmp_dirs())
    return k


_ORDER = {p: i for i, p in enumerate(("startup", "rollout", "update", "log", "checkpoint", "export"))}


def landed_after(k: Kill) -> bool:
    """The kill came after its target phase had ended (the timing the aim was drawn from no longer
    held: another job on the machine during the uninterrupted run made its phases look longer)."""
    return (k.step, _ORDER[k.phase]) > (k.target_step, _ORDER[k.target])


def chaos(
    run: Setup, logs: Path, kills: int, lengths: dict[str, float], rng: random.Random, reach: float = 0.9
) -> tuple[list[Kill], float]:
    """Kill the run `kills` times, aiming each kill at the phase hit least so far (so a missed aim is
    made up later), in the step in progress or, one time in three, the next one, at a random point
    within the first `reach` of the phase's length (halved after a kill that came too late); then let
    the last launch finish. Returns the kills
    and the last launch's seconds."""
    done: list[Kill] = []
    hits: Counter[str] = Counter()
    lengths = dict(lengths)  # the caller's stay the uninterrupted run's
    for n in range(1, kills + 1):
        saved = max(RunDir(run.run_dir).complete(), default=0)
        if saved >= run.steps:
            break  # nothing left to interrupt
        ahead = saved + 2 <= run.steps and rng.random() < 1 / 3
        step = saved + 2 if ahead else saved + 1
        target = min(PHASES, key=lambda p: (hits[p], rng.random()))
        k = kill_once(run, logs / f"launch_{n:02d}.log", n, target, step, rng.uniform(0.0, reach) * lengths[target])
        hits[k.phase] += 1
        if landed_after(k):  # the phase ran shorter in this launch than in the uninterrupted one
            lengths[target] = min(lengths[target], k.delay_s) / 2  # a loaded machine: aim earlier next time
        if done:  # this launch was the resume after the previous kill
            done[-1].resumed_from = resumed_step(logs / f"launch_{n:02d}.log")
        done.append(k)
    last_log = logs / f"launch_{len(done) + 1:02d}.log"
    t0 = time.monotonic()
    proc = launch(run.cmd, last_log)
    if proc.wait() != 0:
        raise RuntimeError(f"the last resume failed (rc {proc.returncode}), see {last_log}")
    seconds = time.monotonic() - t0
    if done:
        done[-1].resumed_from = resumed_step(last_log)
    return done, seconds


# --- checks ---------------------------------------------------------------------------------------


def check_checkpoints(run_dir: Path, model_dir: Path) -> list[str]:
    """Every `step_N` directory must load into a fresh model, AdamW and scheduler through the
    trainer's own loader, with every parameter present and finite, and say it is step N. Returns
    one line per problem."""
    import torch
    from safetensors.torch import load_file

    from agent_r1.trainer.checkpoint import load_checkpoint

    problems = []
    for d in RunDir(run_dir).step_dirs():
        try:
            model, optimizer, scheduler = _fresh_trainee(model_dir)
            meta = load_checkpoint(d, {"policy": model}, optimizer, scheduler)
            names = {n for n, _ in model.named_parameters()}
            state = load_file(str(d / "policy.safetensors"))
            if set(state) != names:
                problems.append(f"{d.name}: tensors {sorted(set(state) ^ names)[:3]} missing or unknown")
            if not all(torch.isfinite(t).all() for t in state.values()):
                problems.append(f"{d.name}: non-finite weights")
            if len(optimizer.state) != len(names):
                problems.append(f"{d.name}: AdamW state for {len(optimizer.state)} of {len(names)} parameters")
            if meta["step"] != int(d.name.split("_")[1]):
                problems.append(f"{d.name}: meta.json says step {meta['step']}")
        except Exception as exc:  # anything that stops a resume is what this check is for
            problems.append(f"{d.name}: {type(exc).__name__}: {exc}")
    return problems


_TRAINEE: dict[Path, Any] = {}


def _fresh_trainee(model_dir: Path):
    """The model the run trains, with an AdamW and a scheduler as the trainer builds them; the
    weights are read once and copied for every check."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from agent_r1.trainer.common import adamw

    if model_dir not in _TRAINEE:
        logging.disable_progress_bar()
        _TRAINEE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir)
    model = copy.deepcopy(_TRAINEE[model_dir])
    optimizer = adamw(list(model.parameters()), 1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)


def read_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def check_metrics(run_dir: Path, straight_dir: Path, steps: int) -> dict[str, Any]:
    """metrics.jsonl: duplicated and missing steps, and the steps whose line differs from the
    uninterrupted run's beyond timings (with the keys that differ)."""
    lines, ref = read_lines(run_dir), {m["step"]: m for m in read_lines(straight_dir)}
    counts = Counter(m["step"] for m in lines)
    differ = {}
    for m in lines:
        keys = sorted(
            k for k in {*m, *ref.get(m["step"], {})} if not k.startswith(VOLATILE) and m.get(k) != ref[m["step"]].get(k)
        )
        if keys:
            differ[m["step"]] = keys
    return {
        "steps": [m["step"] for m in lines],
        "duplicated": sorted(s for s, c in counts.items() if c > 1),
        "missing": sorted(set(range(1, steps + 1)) - set(counts)),
        "differ_from_uninterrupted": differ,
    }


def check_trajectories(run_dir: Path, straight_dir: Path, steps: int) -> dict[str, list[int]]:
    """Every step's trajectory records must read to the end and equal the uninterrupted run's, token
    ids, log-probs and advantages included. The group and trajectory ids are left out: they are
    random labels (uuid4) that differ between any two runs and feed no number."""
    from agent_r1.observe.records import read_records, step_path

    def records(d: Path, step: int) -> list[dict[str, Any]]:
        labels = ("traj_id", "group_id")
        return [{key: v for key, v in r.items() if key not in labels} for r in read_records(step_path(d, step))]

    out: dict[str, list[int]] = {"unreadable": [], "differ_from_uninterrupted": []}
    for k in range(1, steps + 1):
        try:
            mine = records(run_dir, k)
        except (OSError, EOFError, ValueError):
            out["unreadable"].append(k)
            continue
        if mine != records(straight_dir, k):
            out["differ_from_uninterrupted"].append(k)
    return out


def check_groups(run_dir: Path, steps: int) -> dict[str, list]:
    """Asynchronous RL: each step trained `tasks_per_step` (2) whole groups, and no task twice, however
    the kills fell (a resumed producer re-runs the groups the checkpoint had not trained, no others)."""
    from agent_r1.observe.records import read_records, step_path

    tasks: Counter = Counter()
    short = []
    for k in range(1, steps + 1):
        groups = {r["group_id"]: json.dumps(r["task"], sort_keys=True) for r in read_records(step_path(run_dir, k))}
        short += [k] if len(groups) != 2 else []
        tasks.update(groups.values())
    return {"steps_without_2_groups": short, "tasks_trained_twice": [t for t, n in tasks.items() if n > 1]}


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |a - b| over same-named tensors; inf when the names differ."""
    if set(a) != set(b):
        return float("inf")
    return max((float((a[n].double() - b[n].double()).abs().max()) for n in a), default=0.0)


def compare_final(run_dir: Path, straight_dir: Path, steps: int) -> dict[str, float]:
    """The exported policies, and the last checkpoint's weights and AdamW moments, against the
    uninterrupted run's."""
    import torch
    from safetensors.torch import load_file

    out = {"policy": max_abs_diff(*(load_file(str(d / "policy/model.safetensors")) for d in (run_dir, straight_dir)))}
    ck = [d / "checkpoints" / f"step_{steps:06d}" for d in (run_dir, straight_dir)]
    out["checkpoint_weights"] = max_abs_diff(*(load_file(str(c / "policy.safetensors")) for c in ck))
    states = [torch.load(c / "trainer_state.pt", weights_only=False)["optimizer"]["state"] for c in ck]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        out[f"adamw_{key}"] = max_abs_diff(*({str(i): s[key] for i, s in st.items()} for st in states))
    return out


# --- the whole experiment -------------------------------------------------------------------------


def run_chaos(
    out: Path, kills: int, steps: int, seed: int, reach: float = 0.9, max_staleness: int = 0
) -> dict[str, Any]:
    """Model, uninterrupted run, chaos run, checks; the summary as a dict (also written as JSON).
    A smaller `reach` aims the kills earlier in their phases, so fewer land in the next one.

    With `max_staleness` > 0 (asynchronous RL) which groups make a step, and which version sampled
    each token, depend on timing, so the resumed run cannot equal the uninterrupted one: it is held to
    the rest (newest checkpoint, at most one step redone, nothing corrupt, every step logged once)
    and to `check_groups`."""
    t_start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: give a new --out")
    logs = out / "logs"
    logs.mkdir()
    model_dir = make_model(out / "model")
    straight, chaotic = out / "straight", out / "chaos"
    straight_cmd, chaos_cmd = (train_command(model_dir, d, steps, seed, max_staleness) for d in (straight, chaotic))
    tl = timeline(straight_cmd, straight, steps, logs / "straight.log")
    lengths = phase_lengths(tl, read_lines(straight))
    run = Setup(chaos_cmd, chaotic, model_dir, steps)
    done, last_s = chaos(run, logs, kills, lengths, random.Random(seed), reach)
    summary = {
        "command": " ".join(sys.argv),
        "train_command": " ".join(run.cmd[1:]),
        "kills": [asdict(k) | {"steps_redone": k.steps_redone} for k in done],
        "phases": dict(Counter(k.phase for k in done)),
        "resumes": len(done),
        "resumed_from_the_newest_checkpoint": all(k.resumed_from == k.checkpoint_at_kill for k in done),
        "max_steps_redone": max((k.steps_redone or 0 for k in done), default=0),
        "corrupt_checkpoints": sum(len(k.corrupt) for k in done) + len(check_checkpoints(chaotic, model_dir)),
        "tmp_dirs_at_end": len(RunDir(chaotic).tmp_dirs()),
        "metrics": check_metrics(chaotic, straight, steps),
        "trajectories": check_trajectories(chaotic, straight, steps),
        "max_abs_diff": compare_final(chaotic, straight, steps),
        "max_staleness": max_staleness,
        "groups": check_groups(chaotic, steps),
        "phase_lengths_s": lengths,
        "uninterrupted_s": tl["total_s"],
        "last_resume_s": last_s,
        "total_s": time.monotonic() - t_start,
    }
    (out / "chaos.json").write_text(json.dumps(summary, indent=1))
    return summary


def print_summary(s: dict[str, Any]) -> None:
    """One row per kill, then the checks."""
    head = ("kill", "aimed at", "delay", "hit", "step", "ckpt", "resumed", "redone")
    print("{:>4} {:>16} {:>7} {:>10} {:>4} {:>4} {:>7} {:>6}  detail".format(*head))
    for k in s["kills"]:
        aim = f"{k['target']} {k['target_step']}"
        print(
            f"{k['n']:>4} {aim:>16} {k['delay_s']:7.3f} {k['phase']:>10} {k['step']:>4} {k['checkpoint_at_kill']:>4} "
            f"{k['resumed_from']!s:>7} {k['steps_redone']!s:>6}  {k['detail']}"
            + (f"  CORRUPT: {k['corrupt']}" if k["corrupt"] else "")
        )
    m = s["metrics"]
    print(f"\nkills per phase: {s['phases']}; resumes: {s['resumes']}")
    print(f"every resume from the newest complete checkpoint: {s['resumed_from_the_newest_checkpoint']}")
    print(f"most finished steps redone after one kill: {s['max_steps_redone']}")
    print(f"corrupt checkpoints: {s['corrupt_checkpoints']}; .tmp dirs left at the end: {s['tmp_dirs_at_end']}")
    print(f"metrics.jsonl: duplicated {m['duplicated']}, missing {m['missing']}")
    print(f"metrics lines that differ from the uninterrupted run (timings aside): {m['differ_from_uninterrupted']}")
    t = s["trajectories"]
    print(f"trajectory records: unreadable {t['unreadable']}, differ {t['differ_from_uninterrupted']}")
    print(f"max |delta| vs the uninterrupted run: {s['max_abs_diff']}")
    print(f"groups (rollout.max_staleness={s['max_staleness']}): {s['groups']}")
    print(f"uninterrupted run {s['uninterrupted_s']:.1f} s; total {s['total_s']:.1f} s")


def failures(s: dict[str, Any], kills: int) -> list[str]:
    """The properties the chaos run must have, as the list of those that failed."""
    m = s["metrics"]
    checks = {
        f"{kills} kills and as many resumes": s["resumes"] == kills,
        "every resume from the newest complete checkpoint": s["resumed_from_the_newest_checkpoint"],
        "at most the step in progress lost": s["max_steps_redone"] <= 1,
        "no corrupt checkpoint": s["corrupt_checkpoints"] == 0,
        "no half-written checkpoint left": s["tmp_dirs_at_end"] == 0,
        "no duplicated or missing metrics line": not m["duplicated"] and not m["missing"],
        "trajectory records whole": not s["trajectories"]["unreadable"],
        "every step trained 2 groups, no task twice": not any(s["groups"].values()),
    }
    if not s["max_staleness"]:  # lockstep is deterministic: the resumed run is the uninterrupted one
        checks |= {
            "metrics equal the uninterrupted run's": not m["differ_from_uninterrupted"],
            "trajectory records equal": not s["trajectories"]["differ_from_uninterrupted"],
            "final weights and AdamW state equal": all(v <= 1e-6 for v in s["max_abs_diff"].values()),
        }
    return [name for name, ok in checks.items() if not ok]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs, each followed by a resume")
    parser.add_argument("--steps", type=int, default=10, help="RL steps of the run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run and of the kill times")
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"), help="a new or empty directory")
    parser.add_argument("--max-staleness", type=int, default=0, help="rollout.max_staleness (asynchronous RL)")
    args = parser.parse_args()
    summary = run_chaos(args.out, args.kills, args.steps, args.seed, max_staleness=args.max_staleness)
    print_summary(summary)
    failed = failures(summary, args.kills)
    print("\nALL CHECKS PASSED" if not failed else f"\nFAILED: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    # Run as a script, this directory heads sys.path, and its kernels.py would shadow the `kernels`
    # package that transformers probes for (a circular import at the first model class).
    here = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != here]
    main()
