"""`agent-r1 learn`: the RL loop of trainer/rl.py over live traffic, with the interaction store as its producer.

    serve --learn ──commit──> store ──StoreSource.take()──> the RL step (trainer/rl.py, unchanged)
          ^                                                        │
          └──── /v1/load_weights, between tokens <── gate ─── publish()

`StoreSource` has the producer's interface (`take`, `publish`, `state`, `close`), so the step reads exactly
as for a task list. What differs is where groups come from and what publishing means:

* **take**: sessions idle for `session_idle_s` are settled: their implicit signals are stored, the judge
  scores what nothing else did, and each becomes a trajectory (its served answers in turn order, merged
  where the prompts extend). Trajectories whose first prompt is the same form a GRPO group: exploration's
  answers to one prompt, or several sessions that opened alike. A group waits for `group_size`
  trajectories, or `group_wait_s` once it has `min_group`. No user (or session, when users are unnamed)
  gets more than `user_cap` of a batch; the rest wait for a later one. An answer more than
  `rollout.max_staleness` versions older than the trainer's weights is skipped (AReaL's bounded staleness),
  and every token's version is kept for the off-policy correction (decoupled PPO, recomputed old log-probs
  and truncated importance sampling, docs/algorithms.md). The step's interactions are claimed in the store
  before the update, so a resumed trainer releases exactly the claims its checkpoint does not hold.
* **publish** is a gate: the candidate is evaluated greedily on the task's held-out (`val`) split and
  promoted only when it is not worse than the serving version by more than `gate_margin`. A promoted
  version's weights are written where servers read them, recorded as serving, and pushed to every server
  between tokens (no request dropped). A rejected one is logged, serving goes on, and the trainer goes back
  to the serving weights, so it never drifts from what users see.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console

from agent_r1.engines.protocol import Engine, SamplingParams, alias_key, full_state_dict
from agent_r1.evaluate import evaluate
from agent_r1.online.rewards import Judge, JudgeConfig, JudgeError, answer_reward, implicit_rule, session_return
from agent_r1.online.store import Interaction, Store, StoreError
from agent_r1.trainer.config import TrainConfig
from agent_r1.types import Step, Termination, Trajectory
from agent_r1.utils.paths import save_tensors_atomic

JUDGE_RETRY_S = 60.0  # an answer the judge failed on is asked again after this long


@dataclass
class LearnConfig:
    store: str = "runs/online/store.db"
    """the interaction store serve --learn writes: a SQLite file or a PostgreSQL URL"""
    servers: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """the serve --learn servers that take each promoted version (base URLs, without /v1)"""
    versions_dir: str = "runs/online/versions"
    """where promoted weights go: a directory every server can read"""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(run_dir="runs/online/trainer", steps=1000))
    """the RL settings (train.task's val split is the gate's held-out set; tasks_per_step = groups per step,
    group_size = the most trajectories a group contributes)"""
    max_staleness: int = 4
    """the most trainer steps an answer may lag the trainer's weights (train.rollout.max_staleness, which
    is left unset here): answers sampled before the last promotions are still arriving"""
    min_group: int = 2
    """trajectories a group needs before it may be trained (GRPO compares them)"""
    group_wait_s: float = 120.0
    """a group smaller than group_size is trained once its oldest answer is this old"""
    session_idle_s: float = 20.0
    """a session without a request for this long is settled: its implicit signals are final"""
    feedback_wait_s: float = 300.0
    """a settled session that nothing scored (no feedback, no reaction, no judge) is dropped after this long"""
    poll_s: float = 1.0
    """how often the store is read while a step waits for groups"""
    user_cap: float = 0.25
    """the largest share of a batch's trajectories one user (or unnamed session) may have"""
    keep_versions: int = 5
    """weights files kept for rollback: the serving version's, the starting weights', and this many newest
    others (each is the whole model: 0.5 GB for 135M parameters in fp32)"""
    gate_tasks: int = 32
    """held-out tasks the gate evaluates each candidate on"""
    gate_margin: float = 0.0
    """a candidate is promoted when its held-out accuracy >= the serving version's - gate_margin"""
    implicit: str = "default"
    """implicit signals: default (corrections and re-asks 0, going on 1), off, or an import path"""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """scores answers no user reacted to (exploration's): a Python function or an OpenAI-compatible model"""
    retention_days: float = 30.0
    """interactions older than this are deleted from the store (0 = kept forever)"""
    sync: str = "normal"
    """SQLite durability: normal or full (agent_r1/online/store.py)"""

    def __post_init__(self) -> None:
        t = self.train
        waits = (self.group_wait_s, self.session_idle_s, self.feedback_wait_s, self.poll_s, self.retention_days)
        checks = [
            (self.min_group >= 2, f"min_group must be >= 2, got {self.min_group}"),
            (t.rollout.group_size >= self.min_group, "train.rollout.group_size must be >= min_group"),
            (0 < self.user_cap <= 1, f"user_cap must be in (0, 1], got {self.user_cap}"),
            (self.gate_tasks >= 1 and self.gate_margin >= 0, "gate_tasks must be >= 1 and gate_margin >= 0"),
            (self.keep_versions >= 0, f"keep_versions must be >= 0, got {self.keep_versions}"),
            (min(waits) >= 0, "group_wait_s, session_idle_s, feedback_wait_s, poll_s, retention_days must be >= 0"),
            (bool(self.servers), "servers: give at least one serve --learn URL"),
            (not t.lora.enabled, "train.lora.enabled is not supported by agent-r1 learn yet: train the full model"),
            (t.val.every == 0, "train.val.every must be 0: the gate evaluates every candidate (gate_tasks)"),
            (self.max_staleness >= 1, f"max_staleness must be >= 1, got {self.max_staleness}"),
            (
                t.rollout.max_staleness in (0, self.max_staleness),
                "set max_staleness (agent-r1 learn's own key), not train.rollout.max_staleness",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        t.algo.old_logprobs = "recompute"  # a server, older versions: the trainer's log-probs anchor the ratio
        t.rollout.max_staleness = self.max_staleness


class StoreSource:
    """The producer of `agent-r1 learn` (module docstring)."""

    engine: Engine | None = None  # nothing samples in this process but the gate

    def __init__(
        self, cfg: LearnConfig, store: Store, gate: Callable[[torch.nn.Module], float], policy: torch.nn.Module,
        start: int, console: Console,
    ) -> None:  # fmt: skip
        self.cfg, self.store, self.gate, self.policy, self.console = cfg, store, gate, policy, console
        self.step = start
        self.implicit = implicit_rule(cfg.implicit)
        self.judge = Judge(cfg.judge) if cfg.judge.enabled else None
        self.released = store.release_claims(after_step=start)  # their update died with the last process
        serving = store.serving()
        if serving is None:  # the starting weights are version 0: the gate's baseline, a rollback target
            serving = self._promote(policy, start, gate(policy), "the starting weights")
        elif serving.step > start:  # promoted, then killed before its checkpoint: its claims were just released,
            # so what serves must be the checkpoint's weights, or those interactions would count twice
            serving = self._promote(policy, start, gate(policy), f"step {start}'s checkpoint, resumed")
        elif serving.step < start and serving.path:  # a rollback while the trainer was down: it follows
            self._load(serving.path)
        # a token's version is the serving version that sampled it; the trainer counts in its own steps: the step
        # whose weights each version holds, and the step the trainer's weights are (the serving one's after a
        # rejection sent it back)
        self.step_of = {v.version: v.step for v in store.versions()}
        self.basis, self.serving_version = serving.step, serving.version
        self.serving_score = serving.score if serving.score is not None else gate(policy)

    # --- the producer's interface ----------------------------------------------------------------
    def take(self) -> tuple[list[Trajectory], dict[str, float]]:
        """The step's groups, once the store holds `tasks_per_step` trainable ones (claimed before return)."""
        r = self.cfg.train.rollout
        waited = said = time.perf_counter()
        while True:
            groups, metrics = self._groups()
            if len(groups) >= r.tasks_per_step:
                break
            if time.perf_counter() - said > 60:  # a trainer waiting for traffic says so
                said = time.perf_counter()
                self.console.print(f"waiting for traffic: {len(groups)} of {r.tasks_per_step} groups ready")
            time.sleep(self.cfg.poll_s)
        chosen = groups[: r.tasks_per_step]
        trajs = [t for g in chosen for t in g]
        self.step += 1
        self.store.claim([i for t in trajs for i in t.task["interactions"]], self.step)
        if self.cfg.retention_days:
            metrics["online/pruned"] = float(self.store.prune(self.cfg.retention_days * 86400))
        users = collections.Counter(t.task["user"] for t in trajs)
        metrics |= {
            "online/claimed": float(sum(len(t.task["interactions"]) for t in trajs)),
            "online/wait_s": time.perf_counter() - waited,
            "online/groups_ready": float(len(groups)),
            "online/top_user_share": max(users.values()) / len(trajs),
            "online/users": float(len(users)),
            "online/released_claims": float(self.released),
        }
        return trajs, metrics | {f"store/{k}": float(v) for k, v in self.store.counts().items()}

    def publish(self, model: torch.nn.Module) -> dict[str, float]:
        """The gate (module docstring): promote and push, or reject and go back to the serving weights."""
        t0 = time.perf_counter()
        current = self.store.serving()
        if current is not None and current.version != self.serving_version:  # rolled back meanwhile: follow it
            self.console.print(f"version {current.version} serves now ({current.note}): the trainer goes on from it")
            if current.path:
                self._load(current.path)
            self.basis, self.serving_version = current.step, current.version
            self.serving_score = current.score if current.score is not None else self.gate(model)
            return {"gate/promoted": 0.0, "online/followed_rollback": 1.0}
        score = self.gate(model)
        out = {"gate/score": score, "gate/serving_score": self.serving_score}
        if score >= self.serving_score - self.cfg.gate_margin:
            version = self._promote(model, self.step, score, f"gate {score:.3f} >= {self.serving_score:.3f}")
            self.basis, self.serving_score, self.serving_version = self.step, score, version.version
            out |= {"gate/promoted": 1.0, "online/serving_version": float(version.version)}
        else:
            serving = self.store.serving()
            self.store.add_version(self.step, None, score, "rejected", f"gate {score:.3f} < {self.serving_score:.3f}")
            self.console.print(
                f"gate: step {self.step} scored {score:.3f} against the serving version's {self.serving_score:.3f}: "
                "not promoted; serving goes on, the trainer goes back to the serving weights"
            )
            if serving is not None and serving.path:
                self._load(serving.path)
                self.basis = serving.step
            out |= {"gate/promoted": 0.0}
        return out | {"time/gate": time.perf_counter() - t0}

    def state(self) -> dict[str, Any]:
        return {"cursor": 0, "pending": []}  # the store holds what was trained (claims), not the checkpoint

    def switch(self, *_: Any) -> None:
        raise ValueError("agent-r1 learn has no curriculum: the traffic decides what is learned")

    def close(self) -> None:
        if self.judge is not None:
            self.judge.close()

    # --- groups from the store --------------------------------------------------------------------
    def _groups(self) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """Every group trainable now, newest first, the per-user cap applied, and what was left waiting."""
        cfg, now = self.cfg, time.time()
        waiting = self.store.untrained()
        lag = cfg.train.rollout.max_staleness
        self.step_of = {v.version: v.step for v in self.store.versions()}
        stale = {i.id for i in waiting if self.basis - self._step(min(i.versions, default=-1)) > lag}
        if stale:
            self.store.skip(sorted(stale), "stale")
        # the trainer takes log-probs at its sampling temperature: answers sampled at another (greedy ones have
        # none to train) would get a wrong importance ratio
        temperature = cfg.train.rollout.temperature
        other = {i.id for i in waiting if abs(i.temperature - temperature) > 1e-6 and i.id not in stale}
        if other:
            self.store.skip(sorted(other), "temperature")
        waiting = [i for i in waiting if i.id not in stale and i.id not in other]
        sessions = self.store.sessions(i.session for i in waiting)
        settled = {s for s, row in sessions.items() if now - row["last_seen"] >= cfg.session_idle_s}
        trajs, unscored = self._trajectories([i for i in waiting if i.session in settled])
        by_key: dict[str, list[Trajectory]] = collections.defaultdict(list)
        for t in trajs:
            by_key[t.group_id].append(t)
        groups, share = [], collections.Counter()
        budget = cfg.user_cap * cfg.train.rollout.tasks_per_step * cfg.train.rollout.group_size
        capped = 0
        # the newest groups first: under more traffic than the trainer takes, it learns from the freshest (the least
        # stale) and the oldest age out through the staleness bound
        for members in sorted(by_key.values(), key=lambda g: -max(t.task["created"] for t in g)):
            oldest = min(t.task["created"] for t in members)
            full = len(members) >= cfg.train.rollout.group_size
            if not full and (len(members) < cfg.min_group or now - oldest < cfg.group_wait_s):
                continue
            kept, mine = [], share.copy()
            for t in members:
                if len(kept) == cfg.train.rollout.group_size:
                    break
                if mine[t.task["user"]] + 1 > max(1.0, budget):
                    capped += 1
                    continue
                kept.append(t)
                mine[t.task["user"]] += 1
            if len(kept) >= cfg.min_group:
                groups.append(kept)
                share = mine
        return groups, {
            "online/stale_skipped": float(len(stale)),
            "online/other_temperature_skipped": float(len(other)),
            "online/unscored": float(unscored),
            "online/capped": float(capped),
            "online/settled_sessions": float(len(settled)),
        }

    def _trajectories(self, interactions: list[Interaction]) -> tuple[list[Trajectory], int]:
        """Settled interactions as trajectories (a session's served answers; each explored answer alone), with
        the implicit signals and judge scores they lack stored first. Returns them and how many answers wait
        for a judge."""
        if not interactions:
            return [], 0
        served = [i for i in interactions if i.served]
        self._add_implicit(served)
        rewards = self.store.rewards([i.id for i in interactions], sorted({i.session for i in interactions}))
        of_answer: dict[str, list[dict]] = collections.defaultdict(list)
        of_session: dict[str, list[float]] = collections.defaultdict(list)
        for r in rewards:
            if r["interaction"] is not None:
                of_answer[r["interaction"]].append(r)
            elif r["score"] is not None and r["source"] == "explicit":
                of_session[r["session"]].append(r["score"])
        unscored = self._add_judged(interactions, of_answer, of_session)
        out, never, tails = [], [], []
        explored = {i.request for i in interactions if not i.served}
        for key, members in _units(interactions).items():
            if not all(i.trainable for i in members):
                never += [i.id for i in members]
                continue
            scores = [(answer_reward(of_answer[i.id]) or (None, ""))[0] for i in members]
            own = of_session.get(key, []) if members[0].served else []
            scored = [k for k, s in enumerate(scores) if s is not None]
            if not own and scored and scored[-1] < len(members) - 1:  # answers after the last one scored
                if self.judge is not None:
                    continue  # the judge failed on them: the session waits for it
                tails += [i.id for i in members[scored[-1] + 1 :]]  # nobody reacted to them: not trained
                members, scores = members[: scored[-1] + 1], scores[: scored[-1] + 1]
            result = session_return(own, scores)
            if result is None:
                if self.judge is None and time.time() - members[-1].created > self.cfg.feedback_wait_s:
                    never += [i.id for i in members]  # nobody scored it in time, and no judge will
                continue
            for i in members:  # each token's version as the trainer step whose weights sampled it
                i.versions = [self._step(v) for v in i.versions]
            # explored answers are a group of their own request's (the served one with them when it was the whole
            # session): answers to one prompt, scored alike; a session's group: sessions that opened alike
            alone = len(members) == 1 and members[0].request in explored
            group = f"request:{members[0].request}" if not members[0].served or alone else members[0].prompt_hash
            out.append(_trajectory(key, group, members, *result))
        if never:
            self.store.skip(never, "unrewarded")
        if tails:
            self.store.skip(tails, "unscored_tail")
        return out, unscored

    def _add_implicit(self, served: list[Interaction]) -> None:
        """Store the implicit signal of every served answer that has a next user message in its session."""
        if self.implicit is None or not served:
            return
        whole = self.store.session_interactions({i.session for i in served})
        have = {r["interaction"] for r in self.store.rewards([i.id for i in served], []) if r["source"] == "implicit"}
        by_session: dict[str, list[Interaction]] = collections.defaultdict(list)
        for i in whole:
            by_session[i.session].append(i)
        for i in served:
            nxt = next((j for j in by_session[i.session] if j.turn == i.turn + 1), None)
            if i.id in have or nxt is None or not nxt.asks:  # the next request answers a tool call, not the user
                continue
            score = self.implicit(i.user_text, i.answer, nxt.user_text)
            if score is not None:
                self.store.add_reward("implicit", float(score), interaction=i.id, detail={"next": nxt.user_text[:200]})

    def _add_judged(self, interactions: list[Interaction], of_answer: dict, of_session: dict) -> int:
        """Judge scores for answers no other source scored; returns how many still wait (the judge failed)."""
        if self.judge is None:
            return 0
        waiting, now = 0, time.time()
        for i in interactions:
            if answer_reward(of_answer[i.id]) is not None or (i.served and i.session in of_session):
                continue
            failed = [r["created"] for r in of_answer[i.id] if r["source"] == "judge" and r["score"] is None]
            if failed and now - max(failed) < JUDGE_RETRY_S:  # a judge that is down is not asked every poll
                waiting += 1
                continue
            try:
                score = self.judge(i.user_text, i.answer)
            except JudgeError as exc:
                detail = {"error": str(exc), "judge": self.judge.name}
                self.store.add_reward("judge", None, interaction=i.id, detail=detail)
                waiting += 1
                continue
            self.store.add_reward("judge", score, interaction=i.id, detail={"judge": self.judge.name})
            of_answer[i.id].append({"source": "judge", "score": score})
        return waiting

    # --- versions ----------------------------------------------------------------------------------
    def _step(self, version: int) -> int:
        """The trainer step whose weights a serving version holds (a version the store does not know, or none:
        the trainer's own, as a server that never took a push samples the starting weights)."""
        return self.step_of.get(version, self.basis)

    def _promote(self, model: torch.nn.Module, step: int, score: float, note: str):
        """Write the weights where servers read them, record them as serving, push them between tokens."""
        name = f"step-{step:06d}-{uuid.uuid4().hex[:8]}.safetensors"  # a step number may come again after a resume
        path = save_weights(model, Path(self.cfg.versions_dir) / name)
        number = self.store.add_version(step, str(path), score, "serving", note)
        push(self.cfg.servers, str(path), number, self.console)
        self._forget_old()
        return self.store.serving()

    def _forget_old(self) -> None:
        """Delete the weights files past `keep_versions` (never the serving one's, nor the starting weights',
        nor a file a kept version shares, as a rollback's does)."""
        kept = [v for v in self.store.versions() if v.path]
        protected = {v.path for v in kept if v.status == "serving" or v.version == 0}
        others = sorted((v for v in kept if v.path not in protected), key=lambda v: -v.version)
        keep = protected | {v.path for v in others[: self.cfg.keep_versions]}
        for v in others[self.cfg.keep_versions :]:
            self.store.forget_weights(v.version)
            if v.path not in keep:
                Path(v.path).unlink(missing_ok=True)

    def _load(self, path: str) -> None:
        from safetensors.torch import load_file

        load_weights_into(self.policy, load_file(path))


def save_weights(model: torch.nn.Module, path: Path) -> Path:
    """The model's weights (tied ones once) in a safetensors file, through a temporary file and a rename."""
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    seen, tensors = set(), {}
    for name, t in full_state_dict(model).items():
        if (key := alias_key(t)) not in seen:
            seen.add(key)
            tensors[name] = t.detach().to("cpu").contiguous()
    save_tensors_atomic(tensors, path)
    return path


def load_weights_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into `model` in place (the optimizer keeps its parameters); tied weights come once."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected:
        raise StoreError(f"weights file has tensors the model does not: {unexpected[:3]}")
    params = dict(model.state_dict(keep_vars=True))
    loaded = {alias_key(params[k]) for k in tensors}
    if really := [k for k in missing if alias_key(params[k]) not in loaded]:
        raise StoreError(f"weights file lacks {len(really)} of the model's tensors, e.g. {really[0]}")


def push(servers: list[str], path: str, version: int, console: Console) -> int:
    """POST the weights file to every server's /v1/load_weights (between tokens); a server that does not
    answer is reported and skipped: it takes the serving version from the store when it starts again."""
    done = 0
    body = {"path": path, "version": version, "between_tokens": True}
    for url in servers:
        try:
            reply = httpx.post(f"{url.rstrip('/')}/v1/load_weights", json=body, timeout=600)
            reply.raise_for_status()
            done += 1
        except httpx.HTTPError as exc:
            console.print(f"[yellow]push of version {version} to {url} failed: {exc}; it loads it at restart[/yellow]")
    return done


def _units(interactions: list[Interaction]) -> dict[str, list[Interaction]]:
    """What becomes one trajectory each: a session's served answers, one per turn in turn order (an answer
    regenerated for the same turn leaves the chain, and stands alone as every unserved answer does)."""
    units: dict[str, list[Interaction]] = collections.defaultdict(list)
    for i in sorted(interactions, key=lambda i: (i.turn, -i.created)):  # the latest answer of a turn first
        chain = units[i.session]
        if i.served and not (chain and chain[-1].turn == i.turn):
            chain.append(i)
        else:
            units[i.id].append(i)
    return {k: v for k, v in units.items() if v}


def _trajectory(
    key: str, group: str, members: list[Interaction], outcome: float, process: list[float | None]
) -> Trajectory:
    first = members[0]
    steps = [
        Step(
            prompt_ids=i.prompt_ids, response_ids=i.response_ids, response_logprobs=i.logprobs,
            reward=outcome if k == len(members) - 1 else process[k], text=i.answer, index=k,
            finish_reason=i.finish_reason, done=k == len(members) - 1, response_versions=i.versions,
            grammar=i.grammar, state=i.prompt_hash,
        )
        for k, i in enumerate(members)
    ]  # fmt: skip
    task = {"session": first.session, "user": first.user, "created": first.created}
    task["interactions"] = [i.id for i in members]
    return Trajectory(task, key, group, steps, Termination.ANSWERED)


def gate_fn(
    cfg: LearnConfig, engine: Engine, make_env: Callable, tasks: list[dict[str, Any]]
) -> Callable[[torch.nn.Module], float]:
    """Greedy held-out accuracy of the engine's model (the trainer's own: the local engine over it)."""
    sampling = SamplingParams(max_new_tokens=cfg.train.rollout.max_new_tokens, temperature=0.0)

    def gate(model: torch.nn.Module) -> float:
        model.eval()
        engine.sync_weights(model, None)
        metrics, _ = evaluate(engine, make_env, tasks, sampling)
        return metrics["accuracy"]

    return gate


def run_learn(cfg: LearnConfig, console: Console | None = None) -> list[dict[str, float]]:
    """Train on the store's traffic until train.steps steps are done (docs/online.md)."""
    from agent_r1.trainer.rl import train

    console = console or Console()
    store = Store(cfg.store, sync=cfg.sync)
    t = cfg.train

    def source(
        *, engine: Engine, policy: torch.nn.Module, processor: Any, chat: bool, tool_format: str, start: int
    ) -> StoreSource:
        spec = t.task.with_options(t.val.task, prefix="train.val.task.")
        make_env = spec.env_factory(processor, chat, t.rollout.max_turns, tool_format)
        gate = gate_fn(cfg, engine, make_env, spec.tasks("val", cfg.gate_tasks, t.seed))
        return StoreSource(cfg, store, gate, policy, start, console)

    try:
        return train(dataclasses.replace(t), console=console, source=source)
    finally:
        store.close()


@dataclass
class RollbackConfig:
    store: str = "runs/online/store.db"
    """the interaction store"""
    version: int = 0
    """the kept version to serve again (agent-r1 learn's versions table: /v1/learn, or the store)"""
    servers: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """the servers that take it now (others take it when they restart)"""


def run_rollback(cfg: RollbackConfig) -> int:
    """Serve a kept version again: recorded as serving (a new version number with its weights), pushed to
    every server between tokens. A trainer picks it up when it restarts."""
    store = Store(cfg.store, create=False)
    try:
        kept = {v.version: v for v in store.versions() if v.path and os.path.isfile(v.path)}
        if cfg.version not in kept:
            raise ValueError(
                f"version {cfg.version} is not kept in {cfg.store}; kept: {', '.join(map(str, sorted(kept))) or 'none'}"
            )
        old = kept[cfg.version]
        number = store.add_version(old.step, old.path, old.score, "serving", f"rollback to version {old.version}")
        pushed = push(cfg.servers, str(old.path), number, Console())
        print(f"version {old.version} serves again as version {number} ({pushed} of {len(cfg.servers)} servers now)")
        return number
    finally:
        store.close()
