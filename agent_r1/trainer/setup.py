"""What `agent-r1 train` builds before its first step: the components the RL loop (trainer/rl.py) uses.

The loop has no modes. Where the policy lives (one process, or FSDP2 shards under torchrun), which
engine samples (the trainer's own model, vLLM, a server, Ray workers) and how stale a batch may be are
all decided here, once, as the components chosen: `Run.rollout` is the versioned producer
(rollout/producer.py) over a runner for the engine kind and the ranks, `Run.publish` brings the sharded
weights together and hands them to it, the validator owns its engine's memory.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

from agent_r1.algos.rewards import step_rewards
from agent_r1.config import to_dict
from agent_r1.data.sampler import TaskSampler
from agent_r1.distributed import fsdp
from agent_r1.distributed.group import Dist, RankShards, RankZero
from agent_r1.distributed.ray_rollout import RayRollout, connect_ray
from agent_r1.engines import check_installed, make_engine
from agent_r1.engines.protocol import Engine
from agent_r1.env.base import Env
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.models.loading import resolve_model_path
from agent_r1.models.lora import merged_copy
from agent_r1.models.precision import cpu_copy, model_device, resolve_device
from agent_r1.observe.health import HealthMonitor
from agent_r1.observe.loggers import Loggers
from agent_r1.observe.plot import read_metrics
from agent_r1.rollout.producer import EngineGroups, GroupRunner, Producer, has_signal
from agent_r1.task import TaskSpec, resolve_chat, resolve_tool_format
from agent_r1.trainer.checkpoint import export_policy, resume
from agent_r1.trainer.common import adamw, lr_schedule, trained_model
from agent_r1.trainer.config import AlgoConfig, TrainConfig
from agent_r1.trainer.critic import Critic
from agent_r1.trainer.curriculum import Curriculum
from agent_r1.trainer.export import policy_info
from agent_r1.trainer.reference import reference_policy
from agent_r1.trainer.validation import Validator, make_validator
from agent_r1.types import Trajectory
from agent_r1.utils.paths import write_text_atomic

RESUMABLE_CHANGES = ("steps", "resume", "save_every", "keep_last", "run_dir", "log", "health", "device")


@dataclasses.dataclass
class Run:
    """Everything the RL loop touches, built once."""

    dist: Dist
    console: Console
    run_dir: Path
    model: torch.nn.Module  # the model as loaded (its image token, for rows)
    policy: torch.nn.Module  # what the update trains (LoRA-wrapped; FSDP2-sharded under torchrun)
    plain: torch.nn.Module  # the unsharded policy that rolls out, validates and is exported
    processor: Any
    tokenizer: Any
    ref: torch.nn.Module | None
    critic: Critic | None
    modules: dict[str, torch.nn.Module]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    engine: Engine  # this rank's engine: the rollout's in this process, and the validation's
    rollout: Producer | RankZero | Any  # the one path from rollouts to the trainer (agent-r1 learn: the store's)
    recompute: bool  # the trainer recomputes the old log-probs (the engine's numerics, or older policies)
    info: dict[str, Any]
    validator: Validator | None
    loggers: Loggers | None
    health: HealthMonitor
    curriculum: Curriculum | None
    stage: Callable[[TaskSpec], tuple[TaskSampler, Callable[[], Env]]]
    start: int
    ray: RayRollout | None
    offload: Path | None

    def publish(self) -> dict[str, float]:
        """After an update: FSDP2's shards gathered into the unsharded model (torchrun), which the engines
        then sample from. Returns what the transfer cost."""
        if self.dist.world > 1:
            fsdp.copy_full_weights(self.policy, self.plain)
        return self.rollout.publish(self.plain)

    def close(self) -> None:
        """The producer, the engines and Ray's workers stop; the reference's copy on disk goes."""
        self.rollout.close()
        self.engine.close()  # its KV cache (vLLM's weights) are not needed for the export
        if self.ray:
            self.ray.shutdown()
        if self.offload is not None:
            self.offload.unlink(missing_ok=True)  # the starting weights, which a resume writes again
        if self.loggers:
            self.loggers.close()


def build(
    cfg: TrainConfig,
    dist: Dist,
    console: Console,
    model: torch.nn.Module | None,
    tokenizer: Any,
    make_env: Callable[[], Env] | None,
    tasks: list[dict[str, Any]] | None,
    source: Callable[..., Any] | None = None,
) -> Run:
    """The run of `cfg` on this rank, resumed from its last checkpoint when `cfg.resume` says so. `source`
    builds what replaces the producer (agent-r1 learn's interaction store, agent_r1/online/learn.py) from the
    engine, the unsharded policy, the processor, the prompt format and the step the run starts at."""
    if source is not None and dist.world > 1:
        raise ValueError("agent-r1 learn trains in one process: torchrun is not supported yet")
    if tasks is not None and cfg.val.every and "data" not in cfg.val.task:  # fail before any model loads
        raise ValueError("val.every is set and the training tasks were passed in: give val.task.data (a jsonl)")
    check_installed(cfg.rollout.engine)  # vLLM not installed: one line saying how, before any model loads
    if cfg.cluster.rollout_workers and dist.main:
        connect_ray(cfg.cluster.address)  # Ray missing or an address that does not answer: one line, now
    if dist.world > 1 and cfg.lora.enabled:
        raise ValueError("lora.enabled under torchrun is not supported yet: train LoRA in one process")
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    # --- model, reference, critic, optimizer, engine ----------------------------------------------
    chat_hint = cfg.model if model is None else None  # the prompt format of the model actually trained
    model, processor, tokenizer, policy = trained_model(cfg, model, tokenizer)
    if cfg.optim.gradient_checkpointing:  # recompute activations in backward: less memory, ~1/3 more compute
        # transformers 5.20 renamed it (the old name stays as an alias); vLLM 0.32 on a GPU brings 5.19
        enable = getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    offload = run_dir / "reference.safetensors" if cfg.algo.reference_on_disk else None
    ref = reference_policy(policy, cfg.algo.kl_coef, cfg.lora.enabled, sharded=dist.world > 1, offload_to=offload)
    critic = Critic(policy, cfg.algo.critic).to(model_device(policy)) if cfg.algo.estimator == "ppo" else None
    plain = policy  # the unsharded model that rolls out, validates and is exported
    if dist.world > 1:  # FSDP2: each rank keeps 1/N of the trained weights; `plain` gets them after each step
        plain = _unsharded_copy(cfg, policy)
        fsdp.shard(policy)
        if critic is not None:
            fsdp.shard(critic)
    modules: dict[str, torch.nn.Module] = {"policy": policy} | ({"critic": critic} if critic else {})
    params = list({id(p): p for m in modules.values() for p in m.parameters() if p.requires_grad}.values())
    optimizer = adamw(params, cfg.optim.lr, cfg.optim.weight_decay)
    total_updates = cfg.steps * cfg.algo.epochs * cfg.algo.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_schedule(total_updates, cfg.optim.warmup_steps, cfg.optim.schedule)
    )
    engine, runner, ray = _engines(cfg, dist, plain, tokenizer, run_dir, chat_hint is not None)

    # --- task: training tasks, the env factory, validation -------------------------------------------
    chat = resolve_chat(cfg.prompt_format, processor, chat_hint)
    own_task = make_env is None  # the config's task (not an env passed in) is what the policy learns
    tool_format = resolve_tool_format(cfg.tool_format, chat_hint)
    given_env = make_env

    def stage(task: TaskSpec) -> tuple[TaskSampler, Callable[[], Env]]:
        """The training tasks and env factory of `task` (a curriculum rebuilds them at each new stage)."""
        draws = tasks if tasks is not None else task.tasks("train", 4096, cfg.seed)
        env = given_env or task.env_factory(processor, chat, cfg.rollout.max_turns, tool_format)
        if given_env is None and draws:
            env.check_context(draws[0])
        return TaskSampler(draws, cfg.seed), env

    curriculum = Curriculum(cfg.curriculum, cfg.task) if cfg.curriculum.option and own_task else None
    sampler, make_env = stage(curriculum.task if curriculum else cfg.task)
    calls = prompt_format_for(processor, chat, tool_format).tool_format
    info = policy_info(cfg.model, chat, cfg.task.to_raw() if own_task else None, calls)
    validator = None
    if dist.main:  # greedy validation on rank 0's own engine; the other ranks wait in the next collective
        own = runner is None or runner.engine is not engine  # an engine that validates only
        validator = make_validator(
            cfg, engine, None if own_task else make_env, plain, processor, chat, info, console, own
        )

    start, meta = 0, None
    if cfg.resume and (meta := resume(run_dir, to_dict(cfg), modules, optimizer, scheduler, RESUMABLE_CHANGES, dist)):
        if curriculum and meta.get("curriculum"):  # the stage it had reached, then that stage's cursor
            curriculum = Curriculum(cfg.curriculum, cfg.task, meta["curriculum"])
            sampler, make_env = stage(curriculum.task)
        start, sampler.cursor = meta["step"], meta["cursor"]
        if validator:
            validator.restore(meta.get("best"))
        console.print(f"resumed from {meta['path']} (step {start})")
    loggers = None
    if dist.main:
        write_text_atomic(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        loggers = Loggers(cfg.log, run_dir, to_dict(cfg), keep_until=start if start else -1)
    health = HealthMonitor(cfg.health, console)
    if dist.main and start and (run_dir / "metrics.jsonl").is_file():
        # the trend checks compare with the run's first steps, not with the first ones since the resume
        health.history = [m for m in read_metrics(run_dir) if m.get("step", 0) >= 1]

    if dist.world > 1:  # a resume loaded the shards: the unsharded copy takes them before anything samples
        fsdp.copy_full_weights(policy, plain)
    pending = (meta or {}).get("producer", (meta or {}).get("async", {})).get("pending", ())
    if source is not None:  # the producer's interface over another source of trajectories
        parts = {"engine": engine, "policy": plain, "processor": processor, "chat": chat, "start": start}
        rollout = source(**parts, tool_format=calls.name)
    else:
        rollout = _producer(cfg, dist, runner, plain, sampler, make_env, start, pending)
    recompute = cfg.algo.recompute_old_logprobs(cfg.rollout.engine, cfg.dtype, cfg.rollout.max_staleness)
    return Run(
        dist, console, run_dir, model, policy, plain, processor, tokenizer, ref, critic, modules, params, optimizer,
        scheduler, engine, rollout, recompute, info, validator, loggers, health, curriculum, stage, start, ray, offload,
    )  # fmt: skip


def _unsharded_copy(cfg: TrainConfig, policy: torch.nn.Module) -> torch.nn.Module:
    """Under torchrun, the unsharded model each rank keeps: on the policy's device when it decodes there
    (the local engine; the Ray workers' validation engine), on the CPU when vLLM or a server samples, which
    only read its weights at each sync: a whole fp32 model less on every GPU."""
    if cfg.rollout.engine == "local" or cfg.cluster.rollout_workers:
        return copy.deepcopy(policy)
    return cpu_copy(policy)


def _engines(
    cfg: TrainConfig, dist: Dist, plain: torch.nn.Module, tokenizer: Any, run_dir: Path, from_config: bool
) -> tuple[Engine, GroupRunner | None, RayRollout | None]:
    """Every engine of the run, built here: this rank's (the rollout's in this process, and validation's),
    the runner its groups go through (None: rank 0's, under torchrun with asynchronous RL or Ray), and Ray's
    workers, which build theirs from the same spec. This rank's engine is the trainer's own model object
    (no copy), vLLM in this process, or a server; the last two get the policy's weights before the first
    rollout and after every update. Asynchronous RL on the local engine rolls out over a copy of the
    weights (the trainer updates its own in place while episodes go on)."""
    r = cfg.rollout
    spec = r.engine_spec(cfg.seed, cfg.dtype, sync_dir=str(run_dir / "weight_sync"))
    if cfg.cluster.rollout_workers:  # the workers roll out; this engine only validates, over `plain` itself
        engine = make_engine(dataclasses.replace(spec, kind="local"), plain, tokenizer)
        source = _engine_source(cfg, plain, tokenizer, run_dir, from_config) if dist.main else None
        ray = RayRollout(cfg.cluster, r, source, tokenizer, cfg.seed, cfg.dtype) if dist.main else None
        return engine, ray, ray
    if r.engine == "vllm":
        cuda = resolve_device(cfg.device).type == "cuda"  # `plain` may be a CPU copy (`_unsharded_copy`)
        sleep = r.vllm.sleep and cuda and not r.max_staleness  # asynchronous: it rolls out during the update
        path = _engine_source(cfg, plain, tokenizer, run_dir, from_config)
        engine = make_engine(dataclasses.replace(spec, sleep=sleep), path, tokenizer)
    else:
        engine = make_engine(spec, plain, tokenizer)  # local: the trainer's own model object, no copy
    if r.max_staleness and not dist.main:
        return engine, None, None
    rollout_engine = engine
    if r.max_staleness and r.engine == "local":
        rollout_engine = make_engine(r.engine_spec(cfg.seed), merged_copy(plain), tokenizer)
    runner: GroupRunner = EngineGroups(rollout_engine, r.sampling())
    return engine, RankShards(runner, dist) if dist.world > 1 and not r.max_staleness else runner, None


def _engine_source(
    cfg: TrainConfig, policy: torch.nn.Module, tokenizer: Any, run_dir: Path, from_config: bool
) -> str | torch.nn.Module:
    """What a rollout engine other than the trainer's own starts from (its weights are synced anyway):
    the config's model; for a model passed in, a copy on disk for vLLM (which loads a directory), or a
    copy on the CPU (LoRA merged) that Ray ships to its workers: a worker may have no GPU to unpickle
    CUDA tensors on."""
    if from_config:
        return str(resolve_model_path(cfg.model))
    if cfg.rollout.engine == "vllm":
        return str(export_policy(policy, tokenizer, run_dir / "vllm_init"))
    return merged_copy(policy, cpu=True) if cfg.lora.enabled else cpu_copy(policy)


def _producer(
    cfg: TrainConfig, dist: Dist, runner: GroupRunner | None, plain: torch.nn.Module, sampler: TaskSampler,
    make_env: Callable[[], Env], start: int, pending: Any,
) -> Producer | RankZero:  # fmt: skip
    """The producer over `runner`, whose engines first get the policy's weights as version `start`; under
    torchrun rank 0's, which every rank takes from, unless each rank rolls out its share (`RankShards`)."""
    r = cfg.rollout
    producer = None
    if runner is not None:
        runner.sync_weights(plain, start, between_tokens=False)
        producer = Producer(
            runner, sampler, make_env, tasks_per_step=r.tasks_per_step, group_size=r.group_size,
            max_staleness=r.max_staleness, seed=cfg.seed, version=start, pending=pending,
            signal=has_signal(partial(task_return, cfg.algo)) if r.dynamic_sampling else None, max_draws=r.max_draws,
        )  # fmt: skip
    return producer if isinstance(runner, RankShards) or dist.world == 1 else RankZero(producer, dist)


def task_return(algo: AlgoConfig, t: Trajectory) -> float:
    """The episode's return as the estimators see it, from the same `step_rewards` (without PRIME
    normalisation, which is the batch's): the outcome, plus the weighted process rewards unless they are a
    potential's, which telescope away."""
    process = torch.tensor(t.process_rewards, dtype=torch.float64)  # [K]
    outcome = torch.tensor([t.outcome], dtype=torch.float64)  # [1]
    (r,) = step_rewards([process], outcome, algo.process_reward_weight, potential=algo.process_reward_potential)
    return float(r.sum())
