"""The asynchronous producer: AReaL's bound on how far ahead it runs, stale groups dropped, errored groups
left out, and the positions a checkpoint must re-run. A tiny model over 64 ids; tools with latency."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agent_r1.data.sampler import TaskSampler
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.base import StepResult
from agent_r1.rollout import producer as producer_module
from agent_r1.rollout.producer import AsyncRollout, EngineGroups, RolloutStalled
from agent_r1.types import Observation, Termination
from tests.trainer.conftest import tiny_model


class SlowToolEnv:
    """One turn whose tool call takes task["delay"] seconds after the model answered (or raises)."""

    stop = ()

    async def reset(self, task):
        if task.get("down"):
            raise ConnectionError("the sandbox host is down")
        self.task = task
        return Observation(token_ids=list(task["ids"]))

    async def step(self, action):
        await asyncio.sleep(self.task.get("delay", 0.0))
        return StepResult(None, float(action.token_ids[0] < 32), True, {"termination": Termination.ANSWERED})


def producer(tokenizer, tasks, k=1, tps=2, version=0, pending=(), cursor=0):
    model = tiny_model()
    engine = LocalEngine(model, tokenizer, seed=0, max_context=256)
    sampler = TaskSampler(tasks, seed=0)
    sampler.cursor = cursor  # as a checkpoint left it: set before the producer starts drawing
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    engine.weights_version = version  # the trainer's weights, as the trainer loads them before it starts
    source = AsyncRollout(
        EngineGroups(engine, SlowToolEnv, params, seed=0), sampler, tasks_per_step=tps, group_size=2,
        max_staleness=k, version=version, pending=pending,
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
        source.publish(model.state_dict)  # v = 1: two more may start
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
    slow["delay"] = 1.5  # answered at version 0, its tool returns long after
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
            source.publish(model.state_dict)
        assert dropped == 1 and all(t is not slow for t in trained)
        assert 0 not in source.state()["pending"]
    finally:
        source.close()


def test_groups_that_all_error_are_left_out_and_an_env_that_always_fails_stops_the_run(tokenizer):
    tasks = [{"ids": [10 + i, 50], "down": i % 2 == 0} for i in range(16)]
    source, _ = producer(tokenizer, tasks, k=1, tps=2)
    try:
        trajs, m = source.take()
        assert {t.termination for t in trajs} == {Termination.ANSWERED} and m["async/errored_groups"] >= 1
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


class FailingRunner:
    """Ray's errors other than a dead actor, or a runner bug: `run_group` raises instead of returning."""

    engine = None

    def __init__(self):
        self.calls = 0

    async def run_group(self, task, group_size, first_index):
        self.calls += 1
        raise RuntimeError("ray: the object store is full")

    def load_weights(self, state, version, between_tokens=False):
        return None

    def close(self):
        pass


def test_a_group_that_raises_is_counted_as_errored_and_stops_the_run_instead_of_hanging(tokenizer):
    runner = FailingRunner()
    source = AsyncRollout(runner, TaskSampler([{"ids": [10, 50]}], seed=0), tasks_per_step=2, group_size=2,
                          max_staleness=1)  # fmt: skip
    result = {}
    taker = threading.Thread(target=lambda: result.update(out=_take_or_error(source)), daemon=True)
    taker.start()
    taker.join(timeout=30)
    source.close()
    assert not taker.is_alive(), "the trainer is still waiting for groups that raised"
    assert isinstance(result["out"], RolloutStalled)
    assert "the last 8 groups were left out: their episodes all errored" in str(result["out"])
    assert "object store is full" in str(result["out"]) and runner.calls >= 8


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
