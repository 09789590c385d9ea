"""The one path from rollouts to the trainer: a versioned producer of trajectory groups.

`Producer` runs the agent loop in a thread of its own and puts each finished task group into a buffer
that the trainer `take`s a step's batch from; after each update the trainer `publish`es the new weights.
Every mode is this one loop, set by `rollout.max_staleness = k`:

- **k = 0, lockstep**: a step's groups start when the trainer asks for them and run as one cohort with
  the step's seed, so the engine batches them independently of timing and a run is reproducible bit
  for bit; the engine sleeps (gives its memory to the update) once they are in.
- **k > 0, asynchronous** (AReaL's `max_head_offpolicyness`, Fu et al. 2025, arXiv 2505.24298): groups
  run one at a time, seeded by their task position, and start while the groups started (less those left
  out) stay under (v + k + 1) x `tasks_per_step`, v being the trainer's policy version (RL steps done).
  The producer runs at most k steps ahead; after each update the weights go into the engine at the next
  token boundary (partial rollouts) and every token keeps the version that sampled it, which the trainer
  corrects for per token (decoupled PPO, docs/algorithms.md).

`take` filters the stream the same way at every k: a group older than k versions (a straggler), one whose
every episode errored (no evidence about the policy) or one of a curriculum stage already left is left
out and counted, and its place goes to a new group; with dynamic sampling (DAPO, Yu et al. 2025,
arXiv:2503.14476) so is a group whose samples all got the same return, while the step has looked at fewer
than `max_draws` x `tasks_per_step` groups. Groups left out `STALL_GROUPS` steps' worth in a row (a broken
engine or environment) stop the run with `RolloutStalled`.

Where groups run is the runner's business (`GroupRunner`): `EngineGroups` over an engine in this process,
`RankShards` over the ranks of torchrun (distributed/group.py), `RayRollout` over Ray workers
(distributed/ray_rollout.py). A checkpoint keeps `state()`: the next task position and the positions
started but not trained, which a resumed producer rolls out first, with the same seeds.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from agent_r1.data.sampler import TaskSampler
from agent_r1.engines.protocol import Engine, SamplingParams
from agent_r1.env.base import Env
from agent_r1.rollout.agent_loop import AgentEnvLoop, fail
from agent_r1.types import Termination, Trajectory
from agent_r1.utils.malloc import release_memory
from agent_r1.utils.openmp import release_openmp_workers

STALL_GROUPS = 4  # steps' worth of groups in a row left out (all errored, or too stale): the run stops


class RolloutStalled(RuntimeError):
    """The producer cannot fill the buffer (it died, or every episode errors): the run stops cleanly."""


class GroupRunner(Protocol):
    """Where the producer's groups run."""

    engine: Engine | None  # this process's engine; None when the groups run elsewhere (Ray workers)

    async def run(
        self, make_env: Callable[[], Env], tasks: list[dict[str, Any]], group_size: int, seed: int,
        first_index: int, cohort: bool,
    ) -> list[Trajectory]:  # fmt: skip
        """The tasks' `group_size` trajectories each, in task order, seeded as one `AgentEnvLoop(seed=seed)`
        from `first_index` would; `cohort`: batched together independently of timing where the engine can."""
        ...

    def sync_weights(self, model: torch.nn.Module, version: int, between_tokens: bool) -> dict[str, float]:
        """The engine(s) sample from `model`'s weights as `version`; returns what the transfer cost."""
        ...

    def idle(self) -> None:
        """No rollout runs until the next step's: the engine(s) may give their memory back."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """What the runner counted since the last call (Ray's restarts, the ranks' gather time)."""
        ...

    def close(self) -> None:
        """The producer has stopped: no forward pass may go on after this returns."""
        ...


class EngineGroups:
    """Groups rolled out over one engine in this process."""

    def __init__(self, engine: Engine, sampling: SamplingParams) -> None:
        self.engine, self.sampling = engine, sampling

    async def run(
        self, make_env: Callable[[], Env], tasks: list[dict[str, Any]], group_size: int, seed: int,
        first_index: int, cohort: bool,
    ) -> list[Trajectory]:  # fmt: skip
        # cohort=False: a LocalEngine batches this group with whatever else is running, not with itself alone
        loop = AgentEnvLoop(self.engine, make_env, self.sampling, seed=seed)
        return await loop.run(tasks, group_size, first_index, cohort=cohort)

    def sync_weights(self, model: torch.nn.Module, version: int, between_tokens: bool) -> dict[str, float]:
        self.engine.sync_weights(model, version, between_tokens)
        return {}

    def idle(self) -> None:
        self.engine.sleep()  # its KV memory goes to the update (on a GPU, vLLM's until the next sync wakes it)

    def take_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.engine.wait_idle()  # no forward pass goes on after the producer has stopped


@dataclass
class Group:
    """One task's G trajectories, as the producer finished them."""

    position: int  # the task's position in the sampler's order (its seeds follow from it)
    trajs: list[Trajectory]
    started: int  # the policy version when it started
    stage: int = 0  # the curriculum stage it was drawn in


def oldest_version(group: Group) -> int:
    """The version of the group's oldest sampled token (its start, if it sampled none)."""
    versions = [v for t in group.trajs for s in t.steps for v in (s.response_versions or ())]
    return min(versions, default=group.started)


def has_signal(value: Callable[[Trajectory], float]) -> Callable[[list[Trajectory]], bool]:
    """Dynamic sampling's test: whether a group's samples got different returns (`value`: the outcome plus
    the process rewards that the estimators add to it), so that it has a group-relative advantage."""

    def differ(trajs: list[Trajectory]) -> bool:
        return len({round(value(t), 6) for t in trajs if t.steps and t.termination != Termination.ERROR}) > 1

    return differ


class Producer:
    """Runs episodes in its own thread; the trainer `take`s a step's groups and `publish`es its weights."""

    def __init__(
        self,
        runner: GroupRunner,
        sampler: TaskSampler,
        make_env: Callable[[], Env],
        *,
        tasks_per_step: int,
        group_size: int,
        max_staleness: int = 0,
        seed: int = 0,
        version: int = 0,
        pending: Iterable[int] = (),
        signal: Callable[[list[Trajectory]], bool] | None = None,
        max_draws: int = 1,
    ) -> None:
        """`runner`'s engines must already sample from the trainer's weights as `version` (RL steps done).
        `signal`: dynamic sampling's test of a group (`has_signal`), over `max_draws` steps' worth at most."""
        self.runner, self.sampler, self.make_env = runner, sampler, make_env
        self.tasks_per_step, self.group_size, self.max_staleness = tasks_per_step, group_size, max_staleness
        self.seed, self.signal, self.max_draws = seed, signal, max_draws
        self.version = version  # the trainer's policy version: RL steps whose update the engine has
        self._stage = 0  # curriculum stages switched to
        self._round = 0  # lockstep: cohorts started in this step (a replacement's seed differs)
        self._asked = False  # lockstep: the trainer waits for this step's groups
        self._redo = collections.deque(sorted(pending))  # positions a resumed run must still roll out
        self._started = version * tasks_per_step  # groups started (a resumed run's trained ones count)
        self._dropped = 0  # groups dropped as too stale
        self._discarded = 0  # groups left out: their places are free again
        self._unusable_in_a_row = 0
        self._in_flight: set[int] = set()  # positions started and not yet taken by the trainer
        self._ready: collections.deque[Group] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._wake: asyncio.Event | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="agent-r1-rollout", daemon=True)
        self._thread.start()

    # --- the trainer's side ---------------------------------------------------------------------

    def take(self) -> tuple[list[Trajectory], dict[str, float]]:
        """The step's `tasks_per_step` groups (in the order they finished; blocking until they are there)
        and the metrics of what was left out and how stale the rest is (module docstring)."""
        release_memory()  # the update's freed heap goes back to the OS before the rollout allocates
        with self._cond:
            self._asked = True
        self._notify_producer()
        groups: list[Group] = []
        left_out: collections.Counter[str] = collections.Counter()
        uniform = 0  # groups without a signal taken once the step's dynamic-sampling budget was spent
        while len(groups) < self.tasks_per_step:
            group = self._next_ready()
            why = self._unusable(group)
            if why is None and self.signal and not self.signal(group.trajs):
                looked = len(groups) + sum(left_out.values())
                why = ("no_signal", "") if looked < self.max_draws * self.tasks_per_step else None
                uniform += why is None
            if why is None:
                groups.append(group)
                self._unusable_in_a_row = 0
                continue
            left_out[why[0]] += 1
            if why[0] != "no_signal":
                self._unusable_in_a_row += 1
            if self._unusable_in_a_row >= STALL_GROUPS * self.tasks_per_step:
                raise RolloutStalled(
                    f"the last {self._unusable_in_a_row} groups were left out: {why[1]}; stopping, the "
                    "checkpoints on disk are intact"
                )
            with self._cond:
                self._discarded += 1
            self._notify_producer()  # its place goes to a new group
        with self._cond:
            self._asked = False
        if not self.max_staleness:
            self.runner.idle()  # lockstep: nothing rolls out during the update
        release_memory()  # the rollout's freed blocks go back to the OS, not to a heap the update fragments
        self._dropped += left_out["stale"]
        return [t for g in groups for t in g.trajs], self._metrics(groups, left_out, uniform)

    def _unusable(self, group: Group) -> tuple[str, str] | None:
        """Why `group` cannot be trained on (a key and a reason), or None."""
        if group.stage != self._stage:
            return "old_stage", "they were drawn before the curriculum moved on"
        if all(t.termination == Termination.ERROR for t in group.trajs):
            return "errored", f"their episodes all errored (the last: {group.trajs[0].error})"
        if self.version - oldest_version(group) > self.max_staleness:
            return (
                "stale",
                f"they were more than {self.max_staleness} versions old (is the engine getting the weights?)",
            )
        return None

    def _next_ready(self) -> Group:
        with self._cond:
            if not self._ready:  # the trainer waits: its idle OpenMP workers would slow the engine (utils/openmp.py)
                release_openmp_workers()
            self._cond.wait_for(lambda: self._ready or self._error is not None or not self._thread.is_alive())
            if not self._ready:
                why = f": {type(self._error).__name__}: {self._error}" if self._error else ""
                raise RolloutStalled(f"the rollout producer stopped{why}")
            group = self._ready.popleft()
            self._in_flight.discard(group.position)
        if not self._in_flight:  # lockstep: a replacement cohort may start once the last one is taken
            self._notify_producer()
        return group

    @property
    def engine(self) -> Engine | None:
        """The engine the groups run on in this process (None: elsewhere), for its counts."""
        return self.runner.engine

    def publish(self, model: torch.nn.Module) -> dict[str, float]:
        """The update of step `version + 1` is done: the engine samples from `model`'s weights (with k > 0
        at the next token boundary, episodes in flight going on with them), then the producer may start
        that step's groups. Returns what the transfer cost."""
        self.version += 1
        self._round = 0
        transfer = self.runner.sync_weights(model, self.version, between_tokens=self.max_staleness > 0)
        self._notify_producer()
        return transfer

    def switch(self, sampler: TaskSampler, make_env: Callable[[], Env]) -> None:
        """A curriculum's next stage: new groups draw from `sampler` with `make_env`; the old stage's
        groups still running are left out when they arrive."""
        with self._cond:
            self.sampler, self.make_env, self._stage = sampler, make_env, self._stage + 1
            self._redo.clear()

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs to resume without losing or repeating a group: the next position, and
        the positions started but not trained (in flight or waiting in the buffer), which a resumed
        producer rolls out again first."""
        with self._cond:
            return {"cursor": self.sampler.cursor, "pending": sorted(self._in_flight | set(self._redo))}

    def close(self) -> None:
        """Stop producing; episodes in flight are cancelled (their tasks are in `state()['pending']`)."""
        with self._cond:
            self._stop = True
        self._notify_producer()
        self._thread.join(timeout=60)
        self.runner.close()

    # --- the producer thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as exc:  # reported to the trainer by take()
            self._error = exc
        finally:
            with self._cond:
                self._cond.notify_all()

    async def _produce(self) -> None:
        self._aloop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        running: set[asyncio.Task] = set()
        while not self._stop:
            while n := self._may_start():
                if self.max_staleness:  # one group at a time, seeded by its position
                    position = self._next_position()
                    task = self._groups([position], self.seed, position * self.group_size, cohort=False)
                else:  # the step's groups (or their replacements) as one cohort, seeded by the step
                    task = self._cohort([self._next_position() for _ in range(n)])
                running.add(started := asyncio.create_task(task))
                started.add_done_callback(running.discard)
            self._wake.clear()
            await self._wake.wait()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _may_start(self) -> int:
        """How many groups may start now. AReaL's bound: no more groups in flight or waiting than k + 1
        steps' worth; in lockstep only once the trainer asks and the last cohort has been taken."""
        with self._cond:
            free = (self.version + self.max_staleness + 1) * self.tasks_per_step - (self._started - self._discarded)
            if self._stop or free <= 0 or (not self.max_staleness and (not self._asked or self._in_flight)):
                return 0
            return free

    def _next_position(self) -> int:
        with self._cond:
            if self._redo:
                position = self._redo.popleft()
            else:
                position = self.sampler.cursor
                self.sampler.cursor += 1
            self._started += 1
            self._in_flight.add(position)
        return position

    def _cohort(self, positions: list[int]) -> Coroutine[Any, Any, None]:
        """Lockstep's seeds: the step's own, and for a replacement cohort (dynamic sampling, errored
        groups) one derived from the round, with sample indices counted from 0 within the cohort."""
        seed = self.seed * 1_000_003 + self.version
        seed = seed if self._round == 0 else (seed * 1_000_003 + self._round) % 2**62
        self._round += 1
        return self._groups(positions, seed, 0, cohort=True)

    async def _groups(self, positions: list[int], seed: int, first_index: int, cohort: bool) -> None:
        """Roll out the groups and hand them to the trainer, errored if anything raised (a Ray error, a task
        that cannot be read): a group that never came back would leave its place taken and the trainer waiting."""
        version, stage, make_env, sampler, g = self.version, self._stage, self.make_env, self.sampler, self.group_size
        try:
            tasks = [sampler.at(p) for p in positions]
            trajs = await self.runner.run(make_env, tasks, g, seed, first_index, cohort)
        except Exception as exc:
            trajs = [Trajectory(task={}, traj_id=f"p{p}-{i}", group_id=f"p{p}") for p in positions for i in range(g)]
            for traj in trajs:
                fail(traj, exc)
        with self._cond:
            for j, position in enumerate(positions):
                self._ready.append(Group(position, trajs[j * g : (j + 1) * g], version, stage))
            self._cond.notify_all()

    def _notify_producer(self) -> None:
        if self._aloop is not None and self._wake is not None:
            self._aloop.call_soon_threadsafe(self._wake.set)

    def _metrics(self, groups: list[Group], left_out: collections.Counter[str], uniform: int) -> dict[str, float]:
        """What was left out; with k > 0 how stale the batch is (per token: the trainer's version less the
        one that sampled it) and how many episodes span versions."""
        out = {"rollout/errored_groups": float(left_out["errored"])}
        if self.signal:
            out["dynamic_sampling/groups_drawn"] = float(len(groups) + sum(left_out.values()))
            out["dynamic_sampling/groups_kept"] = float(len(groups) - uniform)
        if left_out["old_stage"]:
            out["curriculum/left_out_groups"] = float(left_out["old_stage"])
        if not self.max_staleness:
            return out | self.runner.take_metrics()
        lags = [self.version - v for g in groups for t in g.trajs for s in t.steps for v in (s.response_versions or ())]
        spans = [len({v for s in t.steps for v in (s.response_versions or ())}) > 1 for g in groups for t in g.trajs]
        group_lags = collections.Counter(self.version - oldest_version(g) for g in groups)
        out |= {
            "async/version_lag_mean": sum(lags) / max(1, len(lags)),
            "async/version_lag_max": float(max(lags, default=0)),
            "async/dropped_groups": float(left_out["stale"]),
            "async/dropped_groups_total": float(self._dropped),
            "async/episodes_spanning_versions": sum(spans) / max(1, len(spans)),
            "async/buffered_groups": float(len(self._ready)),
        }
        out |= {f"async/staleness={lag}": n / len(groups) for lag, n in sorted(group_lags.items())}
        return out | self.runner.take_metrics()
