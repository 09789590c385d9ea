"""Rollout workers on Ray: actors that each hold an engine and the task's envs.

`cluster.rollout_workers=N` starts N `RolloutWorker` actors (a local Ray, or the cluster at
`cluster.address`). Each builds its own engine (`LocalEngine` over its own copy of the model, or
`VLLMEngine`) and makes envs with the task's picklable `EnvFactory`. Per RL step the driver:

1. cuts the step's tasks into N consecutive shards; worker k runs `AgentEnvLoop` over its shard with
   the trajectory indices the in-process loop would give them (`first_index`), so per-request seeds
   and therefore the trajectories are those of one loop over the whole batch;
2. gathers the trajectories in task order; each worker also reports the weights version it sampled
   under, and a shard sampled under an older version than the trainer's is detected and left out of
   the update (its episodes count as errors, `ray/stale_episodes`);
3. after the optimizer step, puts the new weights in Ray's object store once (`ray.put`) and has
   every worker load them with the new version number (LocalEngine's and VLLMEngine's `load_weights`).

Asynchronous RL (`rollout.max_staleness > 0`) uses the same workers differently: the producer
(rollout/producer.py) sends one task group at a time (`run_group`) to the least busy worker, whose
engine batches it with the other groups it is running, and after each update the workers load the new
weights between two tokens (`load_weights(..., between_tokens=True)`): episodes in flight go on, each
token keeping the version that sampled it. The workers are async actors for this, so a weight load
and many groups run at once in one worker.

A worker that dies mid-rollout (a crashed env, a killed process, a lost node) is restarted by Ray
(`max_restarts`), reloads the current weights and rolls its shard (or group) out again,
`cluster.retries` times; after that its episodes count as errors and the run goes on. The search
task's index can run as one more actor (`cluster.retrieval_actor`), so workers share one index
instead of building one each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

import torch

from agent_r1.distributed.group import contiguous_shards
from agent_r1.engines import EngineSpec, make_engine
from agent_r1.engines.protocol import SamplingParams, full_state_dict
from agent_r1.rollout.agent_loop import AgentEnvLoop, trajectory_metrics
from agent_r1.types import Termination, Trajectory


def import_ray() -> Any:
    """Ray, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError("cluster.rollout_workers needs Ray: pip install 'agent-r1[cluster]'") from None
    return ray


def connect_ray(address: str = "", num_cpus: int | None = None) -> Any:
    """Join the Ray cluster at `address`, or start a local one (this machine's CPUs); returns `ray`.

    An address that does not answer is a one-line error within seconds (ray.init itself would wait
    for minutes). A local Ray gets this working directory on its workers' import path, so a task given
    as an import path (`task=my_pkg.my_task`) loads there as it does here."""
    ray = import_ray()
    if address and address != "auto":  # checked even when connected: a bad address is the user's mistake
        parsed = urlparse(address if "://" in address else f"ray://{address}")
        host, port = parsed.hostname, parsed.port or (10001 if address.startswith("ray://") else 6379)
        try:
            socket.create_connection((host, port), timeout=5).close()
        except OSError as exc:
            raise ValueError(
                f"cluster.address={address!r} does not answer ({exc}): is `ray start --head` running there?"
            ) from None
    if ray.is_initialized():
        return ray
    if address:  # a cluster, or "auto": the one `ray start` runs on this machine
        ray.init(address=address, log_to_driver=False)
        return ray
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    return ray


class RolloutWorker:
    """One Ray actor: an engine and the task's envs. An async actor: its calls run concurrently on one
    event loop, so a lockstep shard, asynchronous RL's groups and a weight load can overlap (a lockstep
    weight load waits for the running sequences, `between_tokens` does not)."""

    def __init__(self, model: str | torch.nn.Module, tokenizer: Any, make_env: Any, spec: EngineSpec) -> None:
        self.make_env = make_env
        if spec.kind == "local" and isinstance(model, str):
            from agent_r1.models.loading import load_model

            model, tokenizer = load_model(model, device="auto", dtype=spec.dtype)
        self.engine = make_engine(spec, model.eval() if spec.kind == "local" else model, tokenizer)

    async def load_weights(self, state: dict[str, torch.Tensor], version: int, between_tokens: bool = False) -> int:
        # in a thread: the engine's decode thread delivers tokens to this event loop while the load waits for it
        return await asyncio.to_thread(self.engine.load_weights, state, version, between_tokens=between_tokens)

    async def rollout(
        self, tasks: list[dict[str, Any]], group_size: int, sampling: SamplingParams, seed: int, first_index: int
    ) -> tuple[int, list[Trajectory]]:
        """(the weights version sampled under, the trajectories of `tasks` x `group_size`)."""
        version = self.engine.weights_version
        loop = AgentEnvLoop(self.engine, self.make_env, sampling, seed=seed)
        return version, await loop.run(tasks, group_size, first_index)

    async def rollout_group(
        self, task: dict[str, Any], group_size: int, sampling: SamplingParams, seed: int, first_index: int
    ) -> list[Trajectory]:
        """One task group for asynchronous RL, batched with the others this worker runs (no cohort)."""
        loop = AgentEnvLoop(self.engine, self.make_env, sampling, seed=seed)
        return await loop.run([task], group_size, first_index, cohort=False)

    def pid(self) -> int:
        return os.getpid()


class RayRollout:
    """The driver's side: N `RolloutWorker` actors, task sharding, weight broadcast, failures."""

    def __init__(
        self,
        cluster: Any,  # trainer.config.ClusterConfig
        rollout: Any,  # trainer.config.RolloutConfig
        model: str | torch.nn.Module,
        tokenizer: Any,
        make_env: Any,
        seed: int,
        dtype: str,
    ) -> None:
        """`model` is a name or directory every worker loads (vLLM needs a directory), or a plain model
        object, shipped to the workers through the object store."""
        self.ray = connect_ray(cluster.address)
        self.engine = None  # the engines are the workers' (GroupRunner.engine)
        self.retries = cluster.retries
        self.sampling = rollout.sampling()
        self.seed = seed
        self.version = 0
        self._weights: Any = None  # the newest weights in Ray's object store (a restarted worker reloads them)
        self.metrics: dict[str, float] = {}
        self._lock = threading.Lock()  # asynchronous RL counts failures in the producer's thread
        self._load: list[int] = []  # groups running on each worker (asynchronous RL)
        self._dead: set[int] = set()  # workers whose shard was given up on
        self._retrieval = None
        if cluster.retrieval_actor:
            make_env = self._with_retrieval_actor(make_env)
        spec = rollout.engine_spec(seed, dtype)  # dtype: vLLM's, and a local worker's that loads the model
        actor = self.ray.remote(num_cpus=cluster.worker_cpus, num_gpus=cluster.worker_gpus, max_restarts=-1)(
            RolloutWorker
        )
        # the arguments go into the object store once (not once per actor), and this object keeps them
        # there: Ray restarts a dead worker from them (ray-project/ray#53727)
        self._args = [self.ray.put(x) for x in (model, tokenizer, make_env, spec)]
        self.actors = [actor.remote(*self._args) for _ in range(cluster.rollout_workers)]
        self._load = [0] * len(self.actors)

    def sync_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """Every worker loads `model`'s weights as the next version; returns the bytes and seconds."""
        return self.load_weights(full_state_dict(model), self.version + 1)

    def load_weights(
        self, state: Mapping[str, torch.Tensor], version: int, between_tokens: bool = False
    ) -> dict[str, float]:
        """Every worker loads `state` as `version` (with `between_tokens`, at its next token boundary);
        returns the bytes and seconds. A worker that is dead or restarting gets them when it is revived."""
        t0 = time.perf_counter()
        # every name, tied ones too: vLLM redoes a layer's post-load processing (its CPU repacking of the
        # LM head) only for weights it is given
        state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        self._weights, self.version = self.ray.put(state), version
        calls = [a.load_weights.remote(self._weights, version, between_tokens) for a in self.actors]
        for k, call in enumerate(calls):
            try:
                self.ray.get(call)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.ActorUnavailableError):
                self._dead.add(k)  # revived with these weights before its next rollout
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {"ray/weights_mb": nbytes / 2**20, "time/ray_weights": time.perf_counter() - t0}

    async def run_group(self, task: dict[str, Any], group_size: int, first_index: int) -> list[Trajectory]:
        """Asynchronous RL: one task group on the least busy worker. A worker that dies is revived (with
        the current weights) and the group runs again, `cluster.retries` times; then its episodes are
        errors, which the producer leaves out."""
        why = ""
        for attempt in range(self.retries + 1):
            k = min(range(len(self.actors)), key=self._load.__getitem__)
            self._load[k] += 1
            try:
                if k in self._dead:  # it missed a weight load: back, with the current weights, first
                    self._dead.discard(k)
                    await asyncio.to_thread(self._revive, self.actors[k])
                call = self.actors[k].rollout_group.remote(task, group_size, self.sampling, self.seed, first_index)
                return await call
            except self.ray.exceptions.RayActorError as exc:
                why = f"rollout worker {k} died: {str(exc).splitlines()[0][:200]}"
                self._count("ray/restarts" if attempt == 0 else "ray/retries")
                await asyncio.to_thread(self._revive, self.actors[k])
            finally:
                self._load[k] -= 1
        self._count("ray/lost_episodes", group_size)
        return _errored([task], group_size, why)

    def take_metrics(self) -> dict[str, float]:
        """The metrics since the last call (lockstep: the last `run`'s; asynchronous: the groups' failures)."""
        with self._lock:
            out, self.metrics = self.metrics, {}
        return out

    def _count(self, key: str, n: float = 1) -> None:
        with self._lock:
            self.metrics[key] = self.metrics.get(key, 0.0) + n

    def run(self, tasks: list[dict[str, Any]], group_size: int, seed: int) -> list[Trajectory]:
        """The trajectories of `tasks` x `group_size`, in task order, as one AgentEnvLoop would give them."""
        t0 = time.perf_counter()
        while self._dead:  # workers that died last time: back, with the current weights, before they get work
            self._revive(self.actors[self._dead.pop()])
        shards = contiguous_shards(tasks, len(self.actors))
        calls = [
            a.rollout.remote(part, group_size, self.sampling, seed, start * group_size)
            for a, (start, part) in zip(self.actors, shards, strict=True)
        ]
        self.metrics = {"ray/restarts": 0.0, "ray/stale_episodes": 0.0, "ray/lost_episodes": 0.0}
        out: list[Trajectory] = []
        for k, ((start, part), call) in enumerate(zip(shards, calls, strict=True)):
            out += self._collect(k, call, part, group_size, seed, start * group_size)
        self.metrics["time/ray_rollout"] = time.perf_counter() - t0
        self.metrics["ray/trajectories_mb"] = len(pickle.dumps(out)) / 2**20  # what came back over the wire
        return out

    def _collect(self, k: int, call: Any, tasks: list, group_size: int, seed: int, first: int) -> list[Trajectory]:
        """Worker k's trajectories; a dead worker is restarted (by Ray), given the weights, asked again."""
        for attempt in range(self.retries + 1):
            try:
                if attempt:
                    self._revive(self.actors[k])
                    call = self.actors[k].rollout.remote(tasks, group_size, self.sampling, seed, first)
                version, trajs = self.ray.get(call)
                break
            except self.ray.exceptions.RayActorError as exc:
                self.metrics["ray/restarts"] += attempt == 0  # one death, however many tries it takes
                why = str(exc).splitlines()[0][:200]
        else:
            self._dead.add(k)
            self.metrics["ray/lost_episodes"] += len(tasks) * group_size
            return _errored(tasks, group_size, f"rollout worker {k} died: {why}")
        if version != self.version:
            self.metrics["ray/stale_episodes"] += len(trajs)
            why = f"sampled under weights version {version}, the trainer's is {self.version}"
            return _errored(tasks, group_size, why)
        return trajs

    def _revive(self, actor: Any, timeout_s: float = 600.0) -> None:
        """Wait for Ray to restart `actor` (it comes back with its starting weights) and load the current ones."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._weights is not None:
                    self.ray.get(actor.load_weights.remote(self._weights, self.version))
                return
            except self.ray.exceptions.ActorUnavailableError:  # still restarting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def worker_pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        """The producer stopped: a worker's groups were cancelled with it; the workers stay for validation's
        and the next run's weights until `shutdown`."""

    def shutdown(self) -> None:
        for a in self.actors + ([self._retrieval] if self._retrieval else []):
            self.ray.kill(a)
        self.actors = []

    def _with_retrieval_actor(self, make_env: Any) -> Any:
        """Serve the task's search index from one actor; the workers' envs query it over HTTP."""
        if not hasattr(make_env, "options") or not hasattr(make_env.options, "retriever"):
            raise ValueError("cluster.retrieval_actor needs a search task (one with a retriever option)")
        self._retrieval = self.ray.remote(num_cpus=0)(RetrievalActor).remote(make_env.task, make_env.options)
        url = self.ray.get(self._retrieval.url.remote())
        return dataclasses.replace(make_env, options=dataclasses.replace(make_env.options, retriever=url))


class RetrievalActor:
    """The task's search index behind `agent-r1 retrieval-server`'s HTTP API, as a Ray actor."""

    def __init__(self, task: str, options: Any) -> None:
        import threading

        import ray
        import uvicorn

        from agent_r1.retrieval.server import create_app
        from agent_r1.task import load_task

        retriever = load_task(task).retriever(options)
        self.host = ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        sock.close()
        config = uvicorn.Config(create_app(retriever, options.retriever), host=self.host, port=self.port)
        self.server = uvicorn.Server(config)
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.05)

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _errored(tasks: list[dict[str, Any]], group_size: int, why: str) -> list[Trajectory]:
    """Episodes that produced nothing: counted as errors, left out of the update."""
    out = []
    for task in tasks:
        group = uuid.uuid4().hex[:12]
        for g in range(group_size):
            t = Trajectory(task=task, traj_id=f"{group}-{g}", group_id=group, termination=Termination.ERROR, error=why)
            t.metrics = trajectory_metrics(t)
            out.append(t)
    return out
