"""Rollout workers on Ray: actors that each hold an engine and the task's envs.

`cluster.rollout_workers=N` starts N `RolloutWorker` actors (a local Ray, or the cluster at
`cluster.address`). Each builds its own engine (`LocalEngine` over its own copy of the model, or
`VLLMEngine`); the envs come with each rollout, as the task's picklable `EnvFactory` (put in the
object store once per factory). `RayRollout` is the producer's `GroupRunner` (rollout/producer.py):

1. lockstep (`rollout.max_staleness = 0`): a step's cohort is cut into N consecutive shards; worker k
   runs `AgentEnvLoop` over its shard with the trajectory indices the in-process loop would give them
   (`first_index`), so per-request seeds and therefore the trajectories are those of one loop over the
   whole batch, gathered in task order;
2. asynchronous RL: one task group at a time goes to the least busy worker, whose engine batches it
   with the other groups it is running;
3. after the optimizer step the new weights go into Ray's object store once (`ray.put`) and every
   worker loads them with the new version number (between two tokens under asynchronous RL, so
   episodes in flight go on). Every token keeps the version that sampled it, so the producer leaves
   out a group sampled under weights older than it allows, whatever the reason.

A worker that dies mid-rollout (a crashed env, a killed process, a lost node) is restarted by Ray
(`max_restarts`), reloads the current weights and rolls its shard (or group) out again,
`cluster.retries` times; after that its episodes count as errors and the run goes on. A task that
declares a shared service (hotpotqa: its search index, `service(options)` and `using_service(options,
url)`) can run it as one more actor (`cluster.retrieval_actor`), so workers share one instead of
building one each.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    event loop, so asynchronous RL's groups and a weight load between tokens overlap."""

    def __init__(self, model: str | torch.nn.Module, tokenizer: Any, spec: EngineSpec) -> None:
        if spec.kind == "local" and isinstance(model, str):
            from agent_r1.models.loading import load_model

            model, tokenizer = load_model(model, device="auto", dtype=spec.dtype)
        self.engine = make_engine(spec, model.eval() if spec.kind == "local" else model, tokenizer)

    async def load_weights(self, state: dict[str, torch.Tensor], version: int, between_tokens: bool = False) -> int:
        # in a thread: the engine's decode thread delivers tokens to this event loop while the load waits for it
        return await asyncio.to_thread(self.engine.load_weights, state, version, between_tokens=between_tokens)

    async def rollout(
        self, make_env: Any, tasks: list[dict[str, Any]], group_size: int, sampling: SamplingParams, seed: int,
        first_index: int, cohort: bool,
    ) -> list[Trajectory]:  # fmt: skip
        """The trajectories of `tasks` x `group_size`, seeded as one loop over the batch from `first_index`."""
        loop = AgentEnvLoop(self.engine, make_env, sampling, seed=seed)
        return await loop.run(tasks, group_size, first_index, cohort=cohort)

    def sleep(self) -> None:
        self.engine.sleep()

    def pid(self) -> int:
        return os.getpid()


class RayRollout:
    """The driver's side, a `GroupRunner`: N `RolloutWorker` actors, task sharding, weights, failures."""

    def __init__(
        self,
        cluster: Any,  # trainer.config.ClusterConfig
        rollout: Any,  # trainer.config.RolloutConfig
        model: str | torch.nn.Module,
        tokenizer: Any,
        seed: int,
        dtype: str,
    ) -> None:
        """`model` is a name or directory every worker loads (vLLM needs a directory), or a plain model
        object, shipped to the workers through the object store."""
        self.ray = connect_ray(cluster.address)
        self.engine = None  # the engines are the workers' (GroupRunner.engine)
        self.retries = cluster.retries
        self.sampling = rollout.sampling()
        self.version = 0
        self._weights: Any = None  # the newest weights in Ray's object store (a restarted worker reloads them)
        self.metrics: dict[str, float] = {}
        self._lock = threading.Lock()  # counts come from the producer's thread
        self._dead: set[int] = set()  # workers that missed a weight load
        self._service = None if not cluster.retrieval_actor else False  # started with the first env factory
        self._envs: dict[int, tuple[Any, Any]] = {}  # id(make_env) -> (make_env, its object in the store)
        spec = rollout.engine_spec(seed, dtype)  # dtype: vLLM's, and a local worker's that loads the model
        actor = self.ray.remote(num_cpus=cluster.worker_cpus, num_gpus=cluster.worker_gpus, max_restarts=-1)(
            RolloutWorker
        )
        # the arguments go into the object store once (not once per actor), and this object keeps them
        # there: Ray restarts a dead worker from them (ray-project/ray#53727)
        self._args = [self.ray.put(x) for x in (model, tokenizer, spec)]
        self.actors = [actor.remote(*self._args) for _ in range(cluster.rollout_workers)]
        self._load = [0] * len(self.actors)  # rollouts running on each worker

    def sync_weights(self, model: torch.nn.Module, version: int | None = None, between_tokens: bool = False) -> dict:
        """Every worker loads `model`'s weights as `version` (the next by default); returns the bytes and seconds."""
        return self.load_weights(
            full_state_dict(model), self.version + 1 if version is None else version, between_tokens
        )

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

    async def run(
        self, make_env: Any, tasks: list[dict[str, Any]], group_size: int, seed: int, first_index: int, cohort: bool
    ) -> list[Trajectory]:
        """A cohort (lockstep) cut into one consecutive shard per worker, each seeded as its place in the
        whole batch; a single group (asynchronous RL) on the least busy worker, batched there with the
        others it runs. Trajectories come back in task order."""
        env = self._env_object(make_env)
        if not cohort:
            return await self._on_worker(None, env, tasks, group_size, seed, first_index, cohort)
        shards = contiguous_shards(tasks, len(self.actors))
        parts = await asyncio.gather(*(
            self._on_worker(k, env, part, group_size, seed, first_index + start * group_size, cohort)
            for k, (start, part) in enumerate(shards) if part
        ))  # fmt: skip
        out = [t for part in parts for t in part]
        self._count("ray/trajectories_mb", len(pickle.dumps(out)) / 2**20)  # what came back over the wire
        return out

    async def _on_worker(
        self, k: int | None, env: Any, tasks: list, group_size: int, seed: int, first: int, cohort: bool
    ) -> list[Trajectory]:
        """The rollout on worker `k` (None: the least busy). A worker that dies is revived (with the current
        weights) and asked again, `cluster.retries` times; then its episodes are errors, which the producer
        leaves out."""
        why = ""
        for attempt in range(self.retries + 1):
            w = min(range(len(self.actors)), key=self._load.__getitem__) if k is None else k
            self._load[w] += 1
            try:
                if w in self._dead:  # it missed a weight load: back, with the current weights, first
                    self._dead.discard(w)
                    await asyncio.to_thread(self._revive, self.actors[w])
                return await self.actors[w].rollout.remote(env, tasks, group_size, self.sampling, seed, first, cohort)
            except self.ray.exceptions.RayActorError as exc:
                why = f"rollout worker {w} died: {str(exc).splitlines()[0][:200]}"
                self._count("ray/restarts" if attempt == 0 else "ray/retries")
                await asyncio.to_thread(self._revive, self.actors[w])
            finally:
                self._load[w] -= 1
        self._count("ray/lost_episodes", len(tasks) * group_size)
        return _errored(tasks, group_size, why)

    def _env_object(self, make_env: Any) -> Any:
        """`make_env` in the object store, once per factory (a curriculum's next stage is a new one); with
        `cluster.retrieval_actor`, the task's service served by one actor that the workers' envs query."""
        if id(make_env) not in self._envs:
            shipped = make_env
            if self._service is not None:
                shipped = self._with_service(make_env)
            self._envs[id(make_env)] = (make_env, self.ray.put(shipped))  # the factory is kept: its id stays its own
        return self._envs[id(make_env)][1]

    def idle(self) -> None:
        """Lockstep: the workers' engines give their memory back for the update."""
        for call in [a.sleep.remote() for a in self.actors]:
            with contextlib.suppress(self.ray.exceptions.RayActorError):
                self.ray.get(call)

    def take_metrics(self) -> dict[str, float]:
        """The counts since the last call: restarts, retries, lost episodes, what came back over the wire."""
        with self._lock:
            out, self.metrics = {"ray/restarts": 0.0, "ray/lost_episodes": 0.0} | self.metrics, {}
        return out

    def _count(self, key: str, n: float = 1) -> None:
        with self._lock:
            self.metrics[key] = self.metrics.get(key, 0.0) + n

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
        """The producer stopped: a worker's groups were cancelled with it; the workers stay for the next
        run's weights until `shutdown`."""

    def shutdown(self) -> None:
        for a in self.actors + ([self._service] if self._service else []):
            self.ray.kill(a)
        self.actors = []

    def _with_service(self, make_env: Any) -> Any:
        """The task's shared service in one actor; the factory's options point its envs at it."""
        from agent_r1.task import load_task

        module = load_task(make_env.task) if hasattr(make_env, "task") else None
        if not hasattr(module, "service"):
            raise ValueError("cluster.retrieval_actor needs a task that declares a service (service, using_service)")
        if not self._service:
            self._service = self.ray.remote(num_cpus=0)(ServiceActor).remote(make_env.task, make_env.options)
        url = self.ray.get(self._service.url.remote())
        return dataclasses.replace(make_env, options=module.using_service(make_env.options, url))


class ServiceActor:
    """A task's shared service (an ASGI app from its `service(options)`) served over HTTP, as a Ray actor."""

    def __init__(self, task: str, options: Any) -> None:
        import ray
        import uvicorn

        from agent_r1.task import load_task

        app = load_task(task).service(options)
        self.host = ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port))
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
