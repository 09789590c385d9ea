"""Asynchronous RL's rollout side: a continuous, versioned producer of trajectory groups.

With `rollout.max_staleness = k > 0` the trainer no longer waits for a step's slowest episode, and the
engine no longer waits for the update: `AsyncRollout` runs the agent loop in a thread of its own, one
task group at a time, and puts each finished group into a buffer that the trainer takes from.

- **Bounded staleness** (AReaL's `max_head_offpolicyness`, Fu et al. 2025, arXiv 2505.24298): a
  group starts only while the groups started (less those dropped) stay under (v + k + 1) x
  `tasks_per_step`, v being the trainer's policy version (RL steps done). The producer can run at
  most k steps ahead. A group whose oldest token is more than k versions old when the trainer
  takes it (a straggler that finished late) is dropped and counted, never trained.
- **Partial rollouts**: after each update the weights go into the engine at the next token boundary
  (`LocalEngine.load_weights(..., between_tokens=True)`); episodes in flight go on with the new
  weights, and every token keeps the log-prob and the version it was sampled with. A trajectory can
  therefore span versions: the trainer corrects for that per token (decoupled PPO, docs/algorithms.md).
- **Seeds by task position**: group n is the n-th task of the sampler's order and its trajectories
  are seeded from n, so a resumed run re-runs exactly the groups it had not trained (`state`).
- **Where groups run**: `EngineGroups` runs them in this process over any engine that loads weights
  between tokens (`LocalEngine`, `VLLMEngine`, `RemoteEngine`); `RayRollout` (distributed/ray_rollout.py)
  runs each on one of its Ray workers. Both have `run_group` and `load_weights`; the producer needs
  nothing else. Under torchrun the producer lives on rank 0, which broadcasts what it takes.

`rollout.max_staleness = 0` never gets here: the trainer rolls out each step's tasks itself, in
lockstep, exactly as before.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from agent_r1.data.sampler import TaskSampler
from agent_r1.engines.protocol import Engine, SamplingParams
from agent_r1.env.base import Env
from agent_r1.rollout.agent_loop import AgentEnvLoop, fail
from agent_r1.types import Termination, Trajectory
from agent_r1.utils.openmp import release_openmp_workers


class GroupRunner(Protocol):
    """Where the producer's groups run: this process's engine (`EngineGroups`) or Ray workers."""

    engine: Engine | None  # this process's engine; None when the groups run elsewhere (Ray workers)

    async def run_group(self, task: dict[str, Any], group_size: int, first_index: int) -> list[Trajectory]:
        """The task's `group_size` trajectories, seeded by their indices from `first_index`."""
        ...

    def load_weights(self, state: Mapping[str, Any], version: int, between_tokens: bool = False) -> Any:
        """The engine(s) sample from `state` as `version` (episodes in flight go on, with `between_tokens`)."""
        ...

    def close(self) -> None:
        """The producer has stopped: no forward pass may go on after this returns."""
        ...


class EngineGroups:
    """Groups rolled out over one engine in this process, with the task's envs."""

    def __init__(self, engine: Any, make_env: Callable[[], Env], sampling: SamplingParams, seed: int) -> None:
        self.engine = engine
        self.loop = AgentEnvLoop(engine, make_env, sampling, seed=seed)

    async def run_group(self, task: dict[str, Any], group_size: int, first_index: int) -> list[Trajectory]:
        # cohort=False: a LocalEngine batches this group with whatever else is running, not with itself alone
        return await self.loop.run([task], group_size, first_index=first_index, cohort=False)

    def load_weights(self, state: Mapping[str, Any], version: int, between_tokens: bool = False) -> Any:
        return self.engine.load_weights(state, version=version, between_tokens=between_tokens)

    def close(self) -> None:
        self.engine.wait_idle()  # no forward pass goes on after the producer has stopped


STALL_GROUPS = 4  # steps' worth of groups in a row left out (all errored, or too stale): the run stops


class RolloutStalled(RuntimeError):
    """The producer cannot fill the buffer (it died, or every episode errors): the run stops cleanly."""


@dataclass
class Group:
    """One task's G trajectories, as the producer finished them."""

    position: int  # the task's position in the sampler's order (its seeds follow from it)
    trajs: list[Trajectory]
    started: int  # the policy version when it started


def oldest_version(group: Group) -> int:
    """The version of the group's oldest sampled token (its start, if it sampled none)."""
    versions = [v for t in group.trajs for s in t.steps for v in (s.response_versions or ())]
    return min(versions, default=group.started)


class AsyncRollout:
    """Runs episodes continuously in its own thread; the trainer `take`s groups and `publish`es weights."""

    def __init__(
        self,
        runner: GroupRunner,
        sampler: TaskSampler,
        *,
        tasks_per_step: int,
        group_size: int,
        max_staleness: int,
        version: int = 0,
        pending: Iterable[int] = (),
    ) -> None:
        """`runner`'s engines must already sample from the trainer's weights as `version` (RL steps done)."""
        self.runner = runner
        self.sampler = sampler
        self.tasks_per_step, self.group_size, self.max_staleness = tasks_per_step, group_size, max_staleness
        self.version = version  # the trainer's policy version: RL steps whose update the engine has
        self._redo = collections.deque(sorted(pending))  # positions a resumed run must still roll out
        self._started = version * tasks_per_step  # groups started (a resumed run's trained ones count)
        self._dropped = 0  # groups dropped as too stale
        self._discarded = 0  # groups left out (too stale, or every episode errored): their places are free again
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
        """The next `tasks_per_step` groups at most `max_staleness` versions old, in the order they
        finished (blocking until they are there), and the metrics of how stale they were. Groups too
        stale, and groups whose every episode errored (no evidence about the policy), are left out and
        counted; their places go to new groups."""
        groups: list[Group] = []
        dropped = errored = 0
        while len(groups) < self.tasks_per_step:
            group = self._next_ready()
            if all(t.termination == Termination.ERROR for t in group.trajs):
                errored += 1
                why = f"their episodes all errored (the last: {group.trajs[0].error})"
            elif self.version - oldest_version(group) > self.max_staleness:
                dropped += 1
                why = f"they were more than {self.max_staleness} versions old (is the engine getting the weights?)"
            else:
                self._unusable_in_a_row = 0
                groups.append(group)
                continue
            self._unusable_in_a_row += 1
            if self._unusable_in_a_row >= STALL_GROUPS * self.tasks_per_step:
                raise RolloutStalled(
                    f"the last {self._unusable_in_a_row} groups were left out: {why}; stopping, the "
                    "checkpoints on disk are intact"
                )
            with self._cond:
                self._discarded += 1
            self._notify_producer()  # its place goes to a new group
        self._dropped += dropped
        return [t for g in groups for t in g.trajs], self._metrics(groups, dropped, errored)

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
            return group

    def publish(self, weights: Callable[[], dict[str, Any]]) -> None:
        """The update of step `version + 1` is done: its weights go into the engine at the next token
        boundary (in-flight episodes continue on them), then the producer may start that step's groups."""
        self.version += 1
        self.runner.load_weights(weights(), self.version, between_tokens=True)
        self._notify_producer()

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
            while self._may_start():
                position = self._next_position()
                task = asyncio.create_task(self._group(position, self.version))
                running.add(task)
                task.add_done_callback(running.discard)
            self._wake.clear()
            await self._wake.wait()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _may_start(self) -> bool:
        """AReaL's bound: no more groups in flight or waiting than k + 1 steps' worth."""
        limit = (self.version + self.max_staleness + 1) * self.tasks_per_step
        return not self._stop and self._started - self._discarded < limit

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

    async def _group(self, position: int, version: int) -> None:
        """Roll out one group and hand it to the trainer, errored if anything raised (a Ray error, a task that
        cannot be read): a group that never came back would leave its place taken and the trainer waiting."""
        try:
            task = self.sampler.at(position)
            trajs = await self.runner.run_group(task, self.group_size, position * self.group_size)
        except Exception as exc:
            group = f"p{position}"
            trajs = [Trajectory(task={}, traj_id=f"{group}-{g}", group_id=group) for g in range(self.group_size)]
            for traj in trajs:
                fail(traj, exc)
        with self._cond:
            self._ready.append(Group(position, trajs, version))
            self._cond.notify_all()

    def _notify_producer(self) -> None:
        if self._aloop is not None and self._wake is not None:
            self._aloop.call_soon_threadsafe(self._wake.set)

    def _metrics(self, groups: list[Group], dropped: int, errored: int) -> dict[str, float]:
        """How stale the batch is (per token: the trainer's version less the one that sampled it), how
        many groups were left out, and how many episodes span versions."""
        lags = [self.version - v for g in groups for t in g.trajs for s in t.steps for v in (s.response_versions or ())]
        spans = [len({v for s in t.steps for v in (s.response_versions or ())}) > 1 for g in groups for t in g.trajs]
        group_lags = collections.Counter(self.version - oldest_version(g) for g in groups)
        out = {
            "async/version_lag_mean": sum(lags) / max(1, len(lags)),
            "async/version_lag_max": float(max(lags, default=0)),
            "async/dropped_groups": float(dropped),
            "async/dropped_groups_total": float(self._dropped),
            "async/errored_groups": float(errored),
            "async/episodes_spanning_versions": sum(spans) / max(1, len(spans)),
            "async/buffered_groups": float(len(self._ready)),
        }
        return out | {f"async/staleness={lag}": n / len(groups) for lag, n in sorted(group_lags.items())}
