"""The versioned producer, the one path from rollouts to the trainer: lockstep as one loop over a step's
tasks, AReaL's bound on how far ahead it runs, stale groups dropped, errored groups left out, dynamic
sampling and a curriculum's stages as filters on its stream, and the positions a checkpoint must re-run.
A tiny model over 64 ids; tools with latency."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest

from agent_r1.data.sampler import TaskSampler
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.base import Env, StepResult
from agent_r1.rollout import producer as producer_module
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.producer import EngineGroups, Producer, RolloutStalled, has_signal
from agent_r1.types import Observation, Step, Termination, Trajectory
from tests.trainer.conftest import tiny_model


class SlowToolEnv(Env):
    """One turn whose tool call takes task["delay"] seconds after the model answered, or waits for the
    task's "gate" (or raises)."""

    async def reset(self, task):
        if task.get("down"):
            raise ConnectionError("the sandbox host is down")
        self.task = task
        return Observation(token_ids=list(task["ids"]))

    async def step(self, action):
        while (gate := self.task.get("gate")) is not None and not gate.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(self.task.get("delay", 0.0))
        return StepResult(None, float(action.token_ids[0] < 32), True, {"termination": Termination.ANSWERED})


PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0)


def producer(tokenizer, tasks, k=1, tps=2, version=0, pending=(), cursor=0, **options):
    """A producer over a LocalEngine of its own, and the trainer's model (a copy: `publish` copies it in)."""
    model = tiny_model()
    engine = LocalEngine(copy.deepcopy(model), tokenizer, seed=0, max_context=256)
    sampler = TaskSampler(tasks, seed=0)
    sampler.cursor = cursor  # as a checkpoint left it: set before the producer starts drawing
    engine.weights_version = version  # the trainer's weights, as the trainer loads them before it starts
    source = Producer(
        EngineGroups(engine, PARAMS), sampler, SlowToolEnv, tasks_per_step=tps, group_size=2, max_staleness=k,
        version=version, pending=pending, **options,
    )  # fmt: skip
    return source, model


def settle(source, started: int, timeout: float = 10.0) -> None:
    """Wait until the producer has started `started` groups and has nothing left to finish."""
    deadline = time.time() + timeout
    while time.time() < deadline and not (source._started == started and len(source._ready) == len(source._in_flight)):
        time.sleep(0.02)


def test_the_producer_runs_at_most_k_steps_ahead_and_publishing_lets_it_go_on(tokenizer):
    tasks = [{"ids": [10 + i, 50]} for i in range(16)]
    source, model = producer(tokenizer, tasks, k=1, tps=2)
    try:
        trajs, m = source.take()
        assert len(trajs) == 4 and {t.termination for t in trajs} == {Termination.ANSWERED}
        settle(source, 4)
        time.sleep(0.2)
        assert source._started == 4  # (v + k + 1) * tasks_per_step at v = 0: no more, however long we wait
        state = source.state()  # taken: the first two to finish; pending: the other two
        taken = {p for p in range(4) if source.sampler.at(p) in [t.task for t in trajs]}
        assert state["cursor"] == 4 and len(taken) == 2 and taken | set(state["pending"]) == {0, 1, 2, 3}
        assert m["async/version_lag_max"] == 0 and m["async/staleness=0"] == 1.0
        source.publish(model)  # v = 1: two more may start
        settle(source, 6)
        assert source._started == 6 and source.state()["cursor"] == 6
        trajs, m = source.take()
        assert m["async/version_lag_max"] <= 1 and m["async/dropped_groups"] == 0
        assert all(s.response_versions and set(s.response_versions) <= {0, 1} for t in trajs for s in t.steps)
    finally:
        source.close()


def test_a_straggler_older_than_k_is_dropped_and_counted_never_trained(tokenizer):
    tasks = [{"ids": [10 + i, 50]} for i in range(16)]
    source, model = producer(tokenizer, tasks, k=1, tps=2)
    slow = source.sampler.at(0)
    slow["gate"] = threading.Event()  # answered at version 0, its tool returns once the trainer is at 2
    try:
        dropped, trained = 0.0, []
        for _ in range(60):
            trajs, m = source.take()
            trained += [t.task for t in trajs]
            assert m["async/version_lag_max"] <= 1  # nothing trained is more than k updates old
            dropped = m["async/dropped_groups_total"]
            if dropped:
                break
            time.sleep(0.05)  # the update
            source.publish(model)
            if source.version >= 2:
                slow["gate"].set()
        assert dropped == 1 and all(t is not slow for t in trained)
        assert 0 not in source.state()["pending"]
    finally:
        source.close()


def test_groups_that_all_error_are_left_out_and_an_env_that_always_fails_stops_the_run(tokenizer):
    tasks = [{"ids": [10 + i, 50], "down": i % 2 == 0} for i in range(16)]
    source, _ = producer(tokenizer, tasks, k=1, tps=2)
    try:
        trajs, m = source.take()
        assert {t.termination for t in trajs} == {Termination.ANSWERED} and m["rollout/errored_groups"] >= 1
    finally:
        source.close()
    source, _ = producer(tokenizer, [{"ids": [10, 50], "down": True}], k=1, tps=2)
    try:
        with pytest.raises(
            RolloutStalled, match=r"the last 8 groups were left out: their episodes all errored .*sandbox host is down"
        ):
            source.take()
    finally:
        source.close()


class ScriptedRunner:
    """A runner without a model: each task's `outcomes` are its samples' rewards, its `raise` an error."""

    engine = None

    def __init__(self):
        self.calls, self.versions = [], []

    async def run(self, make_env, tasks, group_size, seed, first_index, cohort):
        self.calls.append((len(tasks), seed, first_index, cohort))
        if any(t.get("raise") for t in tasks):
            raise RuntimeError("ray: the object store is full")
        version = self.versions[-1] if self.versions else 0
        return [
            Trajectory(task=t, traj_id=f"{t['id']}-{g}", group_id=str(t["id"]),
                       steps=[Step([1], [2], [0.0], o, done=True, response_versions=[version])])
            for t in tasks for g, o in enumerate(t["outcomes"])
        ]  # fmt: skip

    def sync_weights(self, model, version, between_tokens):
        self.versions.append(version)
        return {}

    def idle(self):
        pass

    def take_metrics(self):
        return {}

    def close(self):
        pass


def test_a_group_that_raises_is_counted_as_errored_and_stops_the_run_instead_of_hanging(tokenizer):
    runner = ScriptedRunner()  # its task raises: Ray's errors other than a dead actor, or a runner bug
    source = Producer(runner, TaskSampler([{"id": 0, "raise": True}], seed=0), SlowToolEnv, tasks_per_step=2,
                      group_size=2, max_staleness=1)  # fmt: skip
    result = {}
    taker = threading.Thread(target=lambda: result.update(out=_take_or_error(source)), daemon=True)
    taker.start()
    taker.join(timeout=30)
    source.close()
    assert not taker.is_alive(), "the trainer is still waiting for groups that raised"
    assert isinstance(result["out"], RolloutStalled)
    assert "the last 8 groups were left out: their episodes all errored" in str(result["out"])
    assert "object store is full" in str(result["out"]) and len(runner.calls) >= 8


def _take_or_error(source):
    try:
        return source.take()
    except RolloutStalled as exc:
        return exc


def test_a_resumed_producer_first_reruns_the_positions_the_checkpoint_had_not_trained(tokenizer):
    tasks = [{"ids": [10 + i, 50]} for i in range(16)]
    source, _ = producer(tokenizer, tasks, k=1, tps=2, version=3, pending=[5, 9], cursor=12)
    try:
        settle(source, 3 * 2 + 4)  # a resumed run's trained groups count: 4 more may start at v = 3, k = 1
        assert source.state() == {"cursor": 14, "pending": [5, 9, 12, 13]}  # the two, then the next two
        trajs, _ = source.take()
        assert {t.task["ids"][0] for t in trajs} <= {source.sampler.at(p)["ids"][0] for p in (5, 9, 12, 13)}
    finally:
        source.close()


def test_an_engine_that_never_gets_the_weights_stops_the_run_instead_of_dropping_forever(tokenizer):
    source, _ = producer(tokenizer, [{"ids": [10 + i, 50]} for i in range(16)], k=1, tps=2)
    try:
        source.take()
        source.version += 2  # the trainer moved on, but no weights reached the engine
        source._notify_producer()
        with pytest.raises(RolloutStalled, match=r"more than 1 versions old \(is the engine getting the weights\?\)"):
            for _ in range(10):
                source.take()
    finally:
        source.close()


def test_a_trainer_that_waits_for_groups_hands_back_its_openmp_workers(tokenizer, monkeypatch):
    """While the trainer waits, its idle OpenMP team would slow every decode step (utils/openmp.py)."""
    released = []
    monkeypatch.setattr(producer_module, "release_openmp_workers", lambda: released.append(threading.get_ident()))
    source, _ = producer(tokenizer, [{"ids": [10 + i, 50], "delay": 0.3} for i in range(4)], k=0, tps=1)
    try:
        source.take()  # nothing is ready for 0.3 s: the trainer waits
    finally:
        source.close()
    assert released and set(released) == {threading.get_ident()}


def test_lockstep_is_one_loop_over_the_steps_tasks_with_the_steps_seed(tokenizer):
    """max_staleness = 0: nothing starts before the trainer asks; then the step's groups run as one cohort,
    exactly as one AgentEnvLoop over those tasks seeded by the step, token for token; the version goes up
    with each publish, and the next step's seed with it."""
    tasks = [{"ids": [10 + i, 50]} for i in range(16)]
    source, model = producer(tokenizer, tasks, k=0, tps=3, seed=5)
    try:
        time.sleep(0.3)
        assert source._started == 0  # lockstep: no rollout runs ahead of the step that asks for it
        for step in range(2):
            trajs, m = source.take()
            engine = LocalEngine(copy.deepcopy(model), tokenizer, seed=0, max_context=256)
            loop = AgentEnvLoop(engine, SlowToolEnv, PARAMS, seed=5 * 1_000_003 + step)
            direct = loop.run_sync([source.sampler.at(p) for p in range(3 * step, 3 * step + 3)], 2)
            assert [t.task for t in trajs] == [t.task for t in direct]
            assert [s.response_ids for t in trajs for s in t.steps] == [s.response_ids for t in direct for s in t.steps]
            assert {v for t in trajs for s in t.steps for v in s.response_versions} == {step}
            assert "async/version_lag_max" not in m and m["rollout/errored_groups"] == 0
            assert source.state() == {"cursor": 3 * (step + 1), "pending": []}
            source.publish(model)
    finally:
        source.close()


def test_dynamic_sampling_replaces_uniform_groups_within_its_budget_at_any_staleness():
    """DAPO's filter on the stream: a group whose samples all got the same return is left out and a new one
    drawn, while the step has looked at fewer than max_draws x tasks_per_step groups; then groups are taken
    as they come. In lockstep the replacements run as one more cohort with a seed of their own."""
    differ, same = [0.0, 1.0], [1.0, 1.0]
    tasks = [{"id": i, "outcomes": o} for i, o in enumerate([same, differ, same, same, differ, same, same, same])]
    for k in (0, 1):
        runner = ScriptedRunner()
        sampler = TaskSampler(tasks, seed=0)
        sampler._order = lambda epoch: list(range(len(tasks)))  # positions in task order
        source = Producer(runner, sampler, SlowToolEnv, tasks_per_step=2, group_size=2, max_staleness=k,
                          signal=has_signal(lambda t: t.outcome), max_draws=2)  # fmt: skip
        try:
            trajs, m = source.take()
        finally:
            source.close()
        kept = sorted({t.group_id for t in trajs})
        assert kept == ["1", "4"] and m["dynamic_sampling/groups_kept"] == 2.0, k
        assert m["dynamic_sampling/groups_drawn"] == 5.0 and m["rollout/errored_groups"] == 0.0
        if k == 0:  # the step's cohort of 2, then one group for each left out, each cohort with a seed of its own
            assert [c[0] for c in runner.calls] == [2, 1, 1, 1] and runner.calls[0][1:] == (0, 0, True)
            assert len({c[1] for c in runner.calls}) == 4 and all(c[2:] == (0, True) for c in runner.calls)
        else:  # one group at a time, seeded by its position
            assert [c[2:] for c in runner.calls] == [(2 * p, False) for p in range(len(runner.calls))]
    runner = ScriptedRunner()  # nothing ever differs: past the budget the step takes what comes
    source = Producer(runner, TaskSampler([{"id": 0, "outcomes": same}], seed=0), SlowToolEnv, tasks_per_step=2,
                      group_size=2, signal=has_signal(lambda t: t.outcome), max_draws=2)  # fmt: skip
    try:
        trajs, m = source.take()
    finally:
        source.close()
    assert len(trajs) == 4 and m["dynamic_sampling/groups_drawn"] == 6.0 and m["dynamic_sampling/groups_kept"] == 0


def test_a_curriculums_next_stage_leaves_out_the_old_stages_groups():
    """`switch`: new groups draw from the next stage's tasks; groups of the old stage still running or
    buffered (asynchronous RL) are left out when they arrive, and counted."""
    runner = ScriptedRunner()
    easy = TaskSampler([{"id": i, "outcomes": [0.0, 1.0]} for i in range(8)], seed=0)
    hard = TaskSampler([{"id": 100 + i, "outcomes": [0.0, 1.0]} for i in range(8)], seed=0)
    source = Producer(runner, easy, SlowToolEnv, tasks_per_step=2, group_size=2, max_staleness=1)
    try:
        trajs, _ = source.take()
        assert all(t.task["id"] < 100 for t in trajs)
        settle(source, 4)  # two more easy groups wait in the buffer
        source.switch(hard, SlowToolEnv)
        source.publish(None)
        trajs, m = source.take()
        assert all(t.task["id"] >= 100 for t in trajs) and m["curriculum/left_out_groups"] == 2.0
        assert source.state()["cursor"] >= 2
    finally:
        source.close()
