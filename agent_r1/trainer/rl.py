"""`agent-r1 train`: the RL loop, readable top to bottom.

    for each step:
      1. rollout      AgentEnvLoop over the task's envs and the engine (by default the trainer's own model),
                      in lockstep; or, with rollout.max_staleness = k > 0, the next groups that a continuous
                      producer finished, none more than k updates old (rollout/producer.py)
      2. rewards      outcome and process rewards told apart; errored episodes left out of the update
      3. rows         each trajectory merged once; reference log-probs (KL) and critic values (PPO)
      4. advantages   one estimator from agent_r1.algos.advantages, broadcast to sampled tokens
      5. update       epochs x mini-batches x packed micro-batches (trainer/update.py)
      6. weight sync  the engine samples from the new weights (a no-op when it holds the same model)
      7. log, validate, checkpoint

Under torchrun (docs/distributed.md) each rank rolls out its share of the tasks and every rank gets all
the trajectories, so steps 2-4 are the same computation everywhere; the model passes of steps 3 and 5
split the rows between the ranks, whose FSDP2 shards make one model. With `cluster.rollout_workers`,
Ray actors roll out instead (rank 0 drives them). Asynchronous RL runs one producer, on rank 0, which
broadcasts each batch. Rank 0 alone logs, validates and exports.

With the local engine in fp32 the importance ratio uses the rollout log-probs (the engine computes
them with the trainer's own model, weights and temperature), so there is no extra "old log-prob"
forward pass; the log-prob consistency test is what makes that safe. vLLM, a server or bf16 compute
have other numerics: the trainer then recomputes the old log-probs and corrects the gap with truncated
importance sampling (algos/off_policy.py). Asynchronous RL does the same, since older policies (several
in one batch, even in one episode) sampled the tokens: decoupled PPO (docs/algorithms.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

from agent_r1.algos import advantages as adv_fns
from agent_r1.algos.rewards import kl_penalized, step_rewards, zero_variance_groups
from agent_r1.config import to_dict
from agent_r1.data.sampler import TaskSampler
from agent_r1.distributed import fsdp
from agent_r1.distributed.group import Dist, contiguous_shards, init_distributed
from agent_r1.distributed.ray_rollout import RayRollout, connect_ray
from agent_r1.engines import check_installed, make_engine
from agent_r1.engines.protocol import engine_busy_s, full_state_dict
from agent_r1.env.base import Env
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.models.loading import load_model, load_processor, place_model, resolve_model_path
from agent_r1.models.lora import merged_copy, with_lora
from agent_r1.models.precision import cpu_copy, model_device, resolve_device
from agent_r1.models.vision import image_token_id
from agent_r1.observe.health import HealthMonitor
from agent_r1.observe.loggers import Loggers
from agent_r1.observe.plot import plot_metrics, read_metrics
from agent_r1.observe.records import step_path
from agent_r1.rollout.agent_loop import AgentEnvLoop, correct, summarize
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.rollout.producer import STALL_GROUPS, AsyncRollout, EngineGroups, GroupRunner, RolloutStalled
from agent_r1.task import TaskSpec, resolve_chat, resolve_tool_format
from agent_r1.trainer.checkpoint import export_policy, resume, save_checkpoint
from agent_r1.trainer.common import adamw, lr_schedule
from agent_r1.trainer.config import AlgoConfig, TrainConfig
from agent_r1.trainer.critic import Critic, fill_old_values, set_gae
from agent_r1.trainer.curriculum import Curriculum
from agent_r1.trainer.export import policy_info
from agent_r1.trainer.reference import reference_policy
from agent_r1.trainer.rows import (
    apply_tis,
    build_rows,
    fill_ref_logprobs,
    recompute_old_logprobs,
    set_step_advantages,
    step_kl,
    write_step_records,
)
from agent_r1.trainer.update import policy_update
from agent_r1.trainer.validation import make_validator
from agent_r1.types import Termination, Trajectory
from agent_r1.utils.malloc import release_memory
from agent_r1.utils.paths import write_text_atomic
from agent_r1.utils.progress import progress_bar

RESUMABLE_CHANGES = ("steps", "resume", "save_every", "keep_last", "run_dir", "log", "health", "device")


def train(
    cfg: TrainConfig,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    make_env: Callable[[], Env] | None = None,
    tasks: list[dict[str, Any]] | None = None,
    console: Console | None = None,
) -> list[dict[str, float]]:
    """Run RL from `cfg`; `model`/`tokenizer`/`make_env`/`tasks` replace the config's model and task."""
    dist = init_distributed(cfg.device)  # torchrun's process group, or a single process
    console = console or Console(quiet=not dist.main)
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
    if model is None:
        model, tokenizer = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype, training=True)
        tokenizer = load_processor(cfg.model) or tokenizer
    # a vision-language model's processor (what formats and exports take), and its tokenizer
    processor, tokenizer = tokenizer, getattr(tokenizer, "tokenizer", tokenizer)
    place_model(model, cfg.device, cfg.dtype)  # a model passed in too: its device, precision and kernels
    policy = with_lora(model, cfg.lora) if cfg.lora.enabled else model
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
    engine = _engine(cfg, plain, tokenizer, run_dir, chat_hint is not None)
    recompute = cfg.algo.recompute_old_logprobs(cfg.rollout.engine, cfg.dtype, cfg.rollout.max_staleness)

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
        validator = make_validator(cfg, engine, None if own_task else make_env, plain, processor, chat, info, console)
    workers = None
    if cfg.cluster.rollout_workers and dist.main:
        source = _engine_source(cfg, plain, tokenizer, run_dir, chat_hint is not None)
        workers = RayRollout(cfg.cluster, cfg.rollout, source, tokenizer, make_env, cfg.seed, cfg.dtype)

    start, meta = 0, None
    if cfg.resume and (meta := resume(run_dir, to_dict(cfg), modules, optimizer, scheduler, RESUMABLE_CHANGES, dist)):
        if curriculum and meta.get("curriculum"):  # the stage it had reached, then that stage's cursor
            curriculum = Curriculum(cfg.curriculum, cfg.task, meta["curriculum"])
            sampler, make_env = stage(curriculum.task)
        start, sampler.cursor = meta["step"], meta["cursor"]
        if validator:
            validator.restore(meta.get("best"))
        console.print(f"resumed from {meta['path']} (step {start})")
    if dist.main:
        write_text_atomic(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
        loggers = Loggers(cfg.log, run_dir, to_dict(cfg), keep_until=start if start else -1)
    health = HealthMonitor(cfg.health, console)
    if dist.main and start and (run_dir / "metrics.jsonl").is_file():
        # the trend checks compare with the run's first steps, not with the first ones since the resume
        health.history = [m for m in read_metrics(run_dir) if m.get("step", 0) >= 1]
    history = []
    lockstep = not cfg.rollout.max_staleness
    runner = None if lockstep or not dist.main else _group_runner(cfg, engine, workers, plain, tokenizer, make_env)
    shared = runner and runner.engine is engine  # the producer's engine is the validator's
    sync = _weight_sync(dist, policy, plain, None if shared else engine, workers if lockstep else None)
    sync()  # the engines start from the policy being trained (after a resume too)
    producer = None
    if runner:  # rollout runs on beside the update; rank 0's producer under torchrun
        runner.load_weights(full_state_dict(plain), start)  # its engines start from the trainer's weights
        r = cfg.rollout
        producer = AsyncRollout(
            runner, sampler, tasks_per_step=r.tasks_per_step, group_size=r.group_size,
            max_staleness=r.max_staleness, version=start, pending=(meta or {}).get("async", {}).get("pending", ()),
        )  # fmt: skip
    if validator and start == 0:  # the starting policy is a candidate too: RL must beat it to be kept
        history.append({"step": 0} | validator(0))
        loggers.log(history[-1], 0)
    stop_producer = contextlib.closing(producer) if producer else contextlib.nullcontext()
    with progress_bar(console) as bar, dist.failure_report() as report, stop_producer:
        task_bar = bar.add_task("RL steps", total=cfg.steps, completed=start)
        rollout_engine = producer.runner.engine if producer else engine
        errored_steps = 0  # steps in a row whose every episode errored
        for step in range(start, cfg.steps):
            t0, report.step = time.perf_counter(), step + 1
            busy = engine_busy_s(rollout_engine)  # seconds of forward passes so far (engines that count them)

            # 1. rollout -------------------------------------------------------------------------------
            policy.eval()
            gather_s, rollout_metrics = 0.0, {}

            def draw(n: int, round_: int, step: int = step, sampler=sampler, make_env=make_env) -> list[Trajectory]:
                """Roll out `n` new tasks (round 0: the step's own seed; dynamic sampling draws more)."""
                nonlocal gather_s
                tasks, seed = sampler.take(n), cfg.seed * 1_000_003 + step
                seed = seed if round_ == 0 else (seed * 1_000_003 + round_) % 2**62
                if cfg.cluster.rollout_workers:  # Ray actors, driven by rank 0
                    return dist.broadcast(workers.run(tasks, cfg.rollout.group_size, seed) if workers else None)
                # this process's engine; under torchrun each rank its consecutive share of the tasks
                start_task, mine = contiguous_shards(tasks, dist.world)[dist.rank]
                loop = AgentEnvLoop(engine, make_env, cfg.rollout.sampling(), seed=seed)
                mine = loop.run_sync(mine, cfg.rollout.group_size, first_index=start_task * cfg.rollout.group_size)
                t_gather = time.perf_counter()
                out = [t for part in dist.gather(mine) for t in part]
                gather_s += time.perf_counter() - t_gather  # torchrun: the ranks' trajectories to every rank
                return out

            if not lockstep:  # asynchronous: the groups the producer finished, none more than k updates old
                trajs, rollout_metrics = _take(producer, dist)
            elif cfg.rollout.dynamic_sampling:  # DAPO: draw until the step's groups all carry a signal
                trajs, rollout_metrics = dynamic_sampling(
                    draw, cfg.rollout.tasks_per_step, cfg.rollout.max_draws, partial(task_return, cfg.algo)
                )
            else:
                trajs = draw(cfg.rollout.tasks_per_step, 0)
            if lockstep:
                engine.sleep()  # the engine's KV memory goes to the update (on a GPU, vLLM's until the sync wakes it)
            release_memory()  # the rollout's freed blocks go back to the OS, not to a heap the update fragments
            t1 = time.perf_counter()

            # 2. rewards: errored or empty episodes are not evidence about the policy: leave them out -----
            if lockstep:  # the async producer stops on its own (AsyncRollout.take)
                errored_steps = _errored_steps(trajs, errored_steps)
            kept = [i for i, t in enumerate(trajs) if t.steps and t.termination != Termination.ERROR]
            train_trajs = [trajs[i] for i in kept]
            rewards = step_rewards(
                [torch.tensor(t.process_rewards, dtype=torch.float64) for t in train_trajs],
                torch.tensor([t.outcome for t in train_trajs], dtype=torch.float64),
                cfg.algo.process_reward_weight,
                cfg.algo.process_reward_norm,
                cfg.algo.process_reward_potential,
            )  # list over trajectories of [K_i]
            groups = [t.group_id for t in train_trajs]
            returns = torch.stack([r.sum() for r in rewards]) if rewards else torch.zeros(0)  # [N] task reward
            zero_var = zero_variance_groups(returns, groups)

            # 3. rows (merged once), reference log-probs, old values ---------------------------------------
            sequences = [merge_trajectory(t) for t in trajs]
            rows, where = build_rows(train_trajs, [sequences[i] for i in kept], image_token_id(model))
            dropped: set[str] = set()  # groups without a group-relative signal
            if cfg.algo.estimator in adv_fns.GROUP_ESTIMATORS:
                alone = {g for g, n in Counter(groups).items() if n == 1}  # the rest errored: no baseline
                dropped = alone | (zero_var if cfg.algo.zero_variance_groups == "skip" else set())
            trained = [groups[ti] not in dropped for ti in where.row_owner]
            off_policy: dict[str, float] = {}
            if recompute:  # the trainer's log-probs are the ratio's anchor; the engine's only weight it (TIS)
                kl_in_reward = ref is not None and cfg.algo.kl_mode == "reward"  # then every row's are used
                need = rows if kl_in_reward else [r for r, keep in zip(rows, trained, strict=True) if keep]
                off_policy = recompute_old_logprobs(
                    policy, need, cfg.optim.micro_batch_tokens, cfg.rollout.temperature, dist,
                    version=None if lockstep else step,  # the trainer's version: RL steps done
                )  # fmt: skip
            kl_reward = 0.0
            if ref is not None and cfg.algo.kl_mode == "reward":  # the KL is part of every return
                fill_ref_logprobs(ref, rows, cfg.optim.micro_batch_tokens, cfg.rollout.temperature, dist)
                kls = step_kl(rows, where, cfg.algo.kl_estimator)
                rewards = kl_penalized(rewards, kls, cfg.algo.kl_coef)
                kl_reward = cfg.algo.kl_coef * float(sum(k.sum() for k in kls)) / max(1, len(kls))
            elif ref is not None:  # only rows the update will see need one
                kept_rows = [r for r, keep in zip(rows, trained, strict=True) if keep]
                fill_ref_logprobs(ref, kept_rows, cfg.optim.micro_batch_tokens, cfg.rollout.temperature, dist)
            if critic is not None:
                fill_old_values(critic, policy, rows, cfg.optim.micro_batch_tokens, dist)
            t2 = time.perf_counter()

            # 4. advantages ---------------------------------------------------------------------------
            a = cfg.algo
            if a.estimator == "ppo":
                set_gae(rows, where, rewards, a.gamma, a.lam, a.gae_level)
            else:
                states = [[s.state for s in t.steps] for t in train_trajs]  # GiGPO's anchor states
                step_adv = adv_fns.outcome_advantages(
                    a.estimator, rewards, groups, where.step_tokens, a.gamma, states, a.step_advantage_weight
                )
                set_step_advantages(rows, where, step_adv)
            if dist.main and cfg.log.trajectories_every and (step + 1) % cfg.log.trajectories_every == 0:
                path = step_path(run_dir, step + 1)
                write_step_records(path, trajs, sequences, kept, rows, where, tokenizer, step + 1)
            rows = [r for r, keep in zip(rows, trained, strict=True) if keep]
            if recompute and cfg.algo.tis_cap:
                off_policy |= apply_tis(rows, cfg.algo.tis_cap)

            # 5. update -----------------------------------------------------------------------------
            release_memory()  # what the reference pass freed (its weights, with reference_on_disk) goes back first
            update = policy_update(policy, critic, rows, optimizer, scheduler, params, cfg, step, dist)
            t3 = time.perf_counter()

            # 6. weight sync: the next rollout samples from the new policy -----------------------------
            transfer = sync() if update["updates"] else {}
            if producer:  # at the next token boundary: episodes in flight go on with the new weights
                producer.publish(lambda: full_state_dict(plain))
            t4 = time.perf_counter()

            # 7. log, validate, checkpoint -----------------------------------------------------------
            metrics = {"step": step + 1, **_rollout_metrics(trajs), **update, **off_policy, **transfer}
            metrics |= workers.take_metrics() if workers else {}  # Ray: restarts, lost and stale episodes, time
            metrics |= rollout_metrics  # async: how stale the batch was, what was left out; dynamic sampling
            metrics["time/trainer_idle_frac"] = (t1 - t0) / max(t4 - t0, 1e-9)  # waiting for trajectories
            if busy is not None:
                metrics["time/engine_idle_frac"] = 1 - (engine_busy_s(rollout_engine) - busy) / max(t4 - t0, 1e-9)
            metrics |= {
                "trained_episodes": len(train_trajs),
                "zero_variance_groups": len(zero_var) / max(1, len(set(groups))),
                "kl_in_reward": kl_reward,
                "lr": scheduler.get_last_lr()[0],
                "time/rollout": t1 - t0,
                "time/reference": t2 - t1,
                "time/update": t3 - t2,
                "time/weight_sync": t4 - t3,
                "time/gather_trajectories": gather_s,
                "time/step": t4 - t0,
                "tokens_per_s/update": update["train_tokens"] / max(t3 - t2, 1e-9),
            }
            if curriculum:  # mastered: the next steps draw the next value's tasks
                if curriculum.update(metrics["accuracy"]):
                    sampler, make_env = stage(curriculum.task)
                    console.print(f"curriculum: task.{cfg.curriculum.option}={curriculum.value} from step {step + 2}")
                metrics["curriculum/stage"] = curriculum.stage
            metrics |= health.update(metrics)
            if validator and ((step + 1) % cfg.val.every == 0 or step + 1 == cfg.steps):
                release_memory()  # the update's freed heap (0.4 GB in the demo) before the validation's keys
                metrics |= validator(step + 1)
            if dist.main:
                loggers.log(metrics, step + 1)
            history.append(metrics)
            bar.update(task_bar, advance=1, description=_describe(metrics))
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                best = validator.best if validator else None  # a resumed run keeps its best step
                extra = {"cursor": sampler.cursor, "config": to_dict(cfg), "best": best, "task": info["task"]}
                extra |= {"curriculum": curriculum.state()} if curriculum else {}
                if producer:  # the position it will start next, and the groups started but not yet trained
                    state = producer.state()  # one snapshot: the cursor and the pending groups agree
                    extra |= {"cursor": state["cursor"], "async": state}
                save_checkpoint(run_dir, step + 1, modules, optimizer, scheduler, extra, cfg.keep_last, dist)
            release_memory()  # the update's activations and the validation's keys, before the next rollout

    engine.close()  # its KV cache (vLLM's weights) are not needed for the export
    if workers:
        workers.shutdown()
    if offload is not None:
        offload.unlink(missing_ok=True)  # the starting weights, which a resume writes again
    if dist.main:
        loggers.close()
        plot_metrics(read_metrics(run_dir), run_dir / "plots" / "curves.png", title=str(run_dir))
        if not (validator and cfg.val.keep_best):  # with keep_best, policy/ already holds the best step
            export_policy(plain, processor, run_dir / "policy", info=info | {"step": cfg.steps})
    dist.close()  # no rank leaves before rank 0 has exported; then the process group ends cleanly
    return history


# --- set-up, weight sync, metrics --------------------------------------------------


def _unsharded_copy(cfg: TrainConfig, policy: torch.nn.Module) -> torch.nn.Module:
    """Under torchrun, the unsharded model each rank keeps: on the policy's device when it decodes there
    (the local engine; the Ray workers' validation engine), on the CPU when vLLM or a server samples, which
    only read its weights at each sync: a whole fp32 model less on every GPU."""
    if cfg.rollout.engine == "local" or cfg.cluster.rollout_workers:
        return copy.deepcopy(policy)
    return cpu_copy(policy)


def _weight_sync(
    dist: Dist, policy: torch.nn.Module, plain: torch.nn.Module, engine: Any | None, workers: RayRollout | None
) -> Callable[[], dict[str, float]]:
    """After an update: FSDP2's shards gathered into the unsharded model (torchrun), then the engine and
    the Ray workers given its weights. Returns what the transfer to the workers cost."""

    def sync() -> dict[str, float]:
        if dist.world > 1:
            fsdp.copy_full_weights(policy, plain)
        if engine is not None:  # asynchronous RL's engines get the weights from the producer instead
            engine.sync_weights(plain)  # a no-op for a local engine over `plain` itself
        return workers.sync_weights(plain) if workers else {}

    return sync


def _group_runner(
    cfg: TrainConfig, engine: Any, workers: RayRollout | None, plain: torch.nn.Module, tokenizer: Any, make_env: Any
) -> GroupRunner:
    """Where asynchronous RL's groups run: the Ray workers; the vLLM engine or the server; or, for the
    local engine, a LocalEngine over a copy of the weights (the trainer updates its own in place)."""
    if workers:
        return workers
    if cfg.rollout.engine != "local":
        return EngineGroups(engine, make_env, cfg.rollout.sampling(), cfg.seed)
    own = make_engine(cfg.rollout.engine_spec(cfg.seed), merged_copy(plain), tokenizer)
    return EngineGroups(own, make_env, cfg.rollout.sampling(), cfg.seed)


def task_return(algo: AlgoConfig, t: Trajectory) -> float:
    """The episode's return as the estimators see it, from the same `step_rewards` (without PRIME
    normalisation, which is the batch's): the outcome, plus the weighted process rewards unless they are a
    potential's, which telescope away."""
    process = torch.tensor(t.process_rewards, dtype=torch.float64)  # [K]
    outcome = torch.tensor([t.outcome], dtype=torch.float64)  # [1]
    (r,) = step_rewards([process], outcome, algo.process_reward_weight, potential=algo.process_reward_potential)
    return float(r.sum())


def dynamic_sampling(
    draw: Callable[[int, int], list[Trajectory]],
    groups: int,
    max_draws: int,
    value: Callable[[Trajectory], float] = lambda t: t.outcome,
) -> tuple[list[Trajectory], dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): a group whose samples all got the same
    return (`value`: the outcome, plus the process rewards that the estimators add to it) has no
    group-relative advantage, so it is dropped and new tasks are drawn (`draw(n, round)`) until `groups`
    groups differ, for `max_draws` rounds at most; a step still short trains on those it has (on the
    first round's groups when none differed). Returns the trajectories and the counts."""
    kept: list[list[Trajectory]] = []
    first: list[Trajectory] = []
    drawn = rounds = 0
    while rounds < max_draws and len(kept) < groups:
        batch = draw(groups - len(kept), rounds)
        first = first or batch
        by_group: dict[str, list[Trajectory]] = {}
        for t in batch:
            by_group.setdefault(t.group_id, []).append(t)
        drawn += len(by_group)
        rounds += 1
        for members in by_group.values():
            outcomes = {round(value(t), 6) for t in members if t.steps and t.termination != Termination.ERROR}
            if len(outcomes) > 1:
                kept.append(members)
    metrics = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/groups_drawn": float(drawn)}
    metrics["dynamic_sampling/groups_kept"] = float(min(len(kept), groups))
    return ([t for members in kept[:groups] for t in members] if kept else first), metrics


def _errored_steps(trajs: list[Trajectory], so_far: int) -> int:
    """Count the lockstep steps in a row whose every episode errored: a broken engine or environment
    gives nothing to learn from, so `STALL_GROUPS` of them stop the run with the last error, as a
    stalled producer does in async mode, instead of training on nothing until `steps`."""
    if not trajs or any(t.termination != Termination.ERROR for t in trajs):
        return 0
    if so_far + 1 >= STALL_GROUPS:
        raise RolloutStalled(
            f"the last {so_far + 1} steps' episodes all errored (the last: {trajs[-1].error}); stopping, the "
            "checkpoints on disk are intact"
        )
    return so_far + 1


def _take(producer: AsyncRollout | None, dist: Dist) -> tuple[list[Trajectory], dict[str, float]]:
    """The producer's next batch (rank 0's, broadcast under torchrun); a stalled producer stops every rank."""
    try:
        out: Any = producer.take() if producer else None
    except RolloutStalled as exc:
        out = exc
    out = dist.broadcast(out)
    if isinstance(out, RolloutStalled):
        raise out
    return out


def _engine(cfg: TrainConfig, policy: torch.nn.Module, tokenizer: Any, run_dir: Path, from_config: bool):
    """rollout.engine: the trainer's own model object (no copy), vLLM in this process, or a server;
    the last two get the policy's weights before the first rollout and after every update. With Ray
    rollout workers, `rollout.engine` is theirs."""
    r = cfg.rollout
    spec = r.engine_spec(cfg.seed, cfg.dtype, sync_dir=str(run_dir / "weight_sync"))
    if cfg.cluster.rollout_workers:  # Ray workers roll out; this engine only validates, over `policy` itself
        return make_engine(dataclasses.replace(spec, kind="local"), policy, tokenizer)
    if r.engine == "vllm":
        cuda = resolve_device(cfg.device).type == "cuda"  # `policy` may be a CPU copy (`_unsharded_copy`)
        sleep = r.vllm.sleep and cuda and not r.max_staleness  # asynchronous: it rolls out during the update
        path = _engine_source(cfg, policy, tokenizer, run_dir, from_config)
        return make_engine(dataclasses.replace(spec, sleep=sleep), path, tokenizer)
    return make_engine(spec, policy, tokenizer)  # local: the trainer's own model object, no copy


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


def _rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    m = summarize(trajs)
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    return m | {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(trajs) > 1 else 0.0,
        "accuracy": sum(map(correct, trajs)) / max(1, len(trajs)),
    }


def _describe(m: dict[str, float]) -> str:
    return f"RL step {m['step']}: reward {m['reward_mean']:.2f} acc {m['accuracy']:.0%} ({m['time/step']:.0f}s)"
