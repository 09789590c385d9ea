"""`agent-r1 train`: the RL loop, readable top to bottom.

    for each step:
      1. rollout      the step's trajectory groups from the versioned producer (rollout/producer.py): in
                      lockstep, or with rollout.max_staleness = k > 0 none more than k updates old
      2. rewards      outcome and process rewards told apart; errored episodes left out of the update
      3. rows         each trajectory merged once; reference log-probs (KL) and critic values (PPO)
      4. advantages   one estimator from agent_r1.algos.advantages, broadcast to sampled tokens
      5. update       epochs x mini-batches x packed micro-batches (trainer/update.py)
      6. publish      the engine samples from the new weights (a no-op when it holds the same model)
      7. log, validate, checkpoint

What runs where (one process or torchrun's ranks with FSDP2 shards, the trainer's own model, vLLM, a
server or Ray workers) is chosen once, when the run is built (trainer/setup.py); the loop is the same
for all. Under torchrun every rank gets all the trajectories, so steps 2-4 are the same computation
everywhere; the model passes of steps 3 and 5 split the rows between the ranks. Rank 0 alone logs,
validates and exports.

With the local engine in fp32 the importance ratio uses the rollout log-probs (the engine computes
them with the trainer's own model, weights and temperature), so there is no extra "old log-prob"
forward pass; the log-prob consistency test is what makes that safe. vLLM, a server or bf16 compute
have other numerics: the trainer then recomputes the old log-probs and corrects the gap with truncated
importance sampling (algos/off_policy.py). Asynchronous RL does the same, since older policies (several
in one batch, even in one episode) sampled the tokens: decoupled PPO (docs/algorithms.md).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console

from agent_r1.algos import advantages as adv_fns
from agent_r1.algos.rewards import kl_penalized, step_rewards, zero_variance_groups
from agent_r1.config import to_dict
from agent_r1.distributed.group import init_distributed
from agent_r1.engines.protocol import engine_busy_s
from agent_r1.env.base import Env
from agent_r1.models.grammar import model_grammars
from agent_r1.models.vision import image_token_id
from agent_r1.observe.plot import plot_metrics, read_metrics
from agent_r1.observe.records import step_path
from agent_r1.rollout.agent_loop import correct, summarize
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.trainer.checkpoint import export_policy, save_checkpoint
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.critic import fill_old_values, set_gae
from agent_r1.trainer.rows import (
    apply_tis,
    build_rows,
    fill_ref_logprobs,
    recompute_old_logprobs,
    set_step_advantages,
    step_kl,
    write_step_records,
)
from agent_r1.trainer.setup import Run, build
from agent_r1.trainer.update import policy_update
from agent_r1.types import Termination, Trajectory
from agent_r1.utils.progress import progress_bar


def train(
    cfg: TrainConfig,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    make_env: Callable[[], Env] | None = None,
    tasks: list[dict[str, Any]] | None = None,
    console: Console | None = None,
    source: Callable[..., Any] | None = None,
) -> list[dict[str, float]]:
    """Run RL from `cfg`; `model`/`tokenizer`/`make_env`/`tasks` replace the config's model and task, `source`
    the producer (trainer/setup.py: agent-r1 learn's interaction store)."""
    dist = init_distributed(cfg.device)  # torchrun's process group, or a single process
    console = console or Console(quiet=not dist.main)
    run = build(cfg, dist, console, model, tokenizer, make_env, tasks, source)
    policy, ref, critic, validator = run.policy, run.ref, run.critic, run.validator
    history = []
    with progress_bar(console) as bar, dist.failure_report() as report, contextlib.closing(run):
        if validator and run.start == 0:  # the starting policy is a candidate too: RL must beat it to be kept
            history.append({"step": 0} | validator(0))
            run.loggers.log(history[-1], 0)
        task_bar = bar.add_task("RL steps", total=cfg.steps, completed=run.start)
        for step in range(run.start, cfg.steps):
            t0, report.step = time.perf_counter(), step + 1
            busy = engine_busy_s(run.rollout.engine)  # seconds of forward passes so far (engines that count them)

            # 1. rollout: the step's groups, errored, stale and (dynamic sampling) uniform ones left out
            policy.eval()
            trajs, rollout_metrics = run.rollout.take()
            t1 = time.perf_counter()

            # 2. rewards: errored or empty episodes are not evidence about the policy: leave them out -----
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

            # 3. rows (merged once), reference log-probs, old values -----------------------------------
            sequences = [merge_trajectory(t) for t in trajs]
            rows, where = build_rows(
                train_trajs,
                [sequences[i] for i in kept],
                image_token_id(run.model),
                lambda: model_grammars(run.model, run.tokenizer),
            )
            dropped: set[str] = set()  # groups without a group-relative signal
            if cfg.algo.estimator in adv_fns.GROUP_ESTIMATORS:
                alone = {g for g, n in Counter(groups).items() if n == 1}  # the rest errored: no baseline
                dropped = alone | (zero_var if cfg.algo.zero_variance_groups == "skip" else set())
            trained = [groups[ti] not in dropped for ti in where.row_owner]
            off_policy: dict[str, float] = {}
            mb, temperature = cfg.optim.micro_batch_tokens, cfg.rollout.temperature
            if run.recompute:  # the trainer's log-probs are the ratio's anchor; the engine's only weight it (TIS)
                kl_in_reward = ref is not None and cfg.algo.kl_mode == "reward"  # then every row's are used
                need = rows if kl_in_reward else [r for r, keep in zip(rows, trained, strict=True) if keep]
                version = step if cfg.rollout.max_staleness else None  # the trainer's version: RL steps done
                off_policy = recompute_old_logprobs(policy, need, mb, temperature, dist, version=version)
            kl_reward = 0.0
            if ref is not None and cfg.algo.kl_mode == "reward":  # the KL is part of every return
                fill_ref_logprobs(ref, rows, mb, temperature, dist)
                kls = step_kl(rows, where, cfg.algo.kl_estimator)
                rewards = kl_penalized(rewards, kls, cfg.algo.kl_coef)
                kl_reward = cfg.algo.kl_coef * float(sum(k.sum() for k in kls)) / max(1, len(kls))
            elif ref is not None:  # only rows the update will see need one
                fill_ref_logprobs(
                    ref, [r for r, keep in zip(rows, trained, strict=True) if keep], mb, temperature, dist
                )
            if critic is not None:
                fill_old_values(critic, policy, rows, mb, dist)
            t2 = time.perf_counter()

            # 4. advantages -------------------------------------------------------------------------
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
                path = step_path(run.run_dir, step + 1)
                write_step_records(path, trajs, sequences, kept, rows, where, run.tokenizer, step + 1)
            rows = [r for r, keep in zip(rows, trained, strict=True) if keep]
            if run.recompute and cfg.algo.tis_cap:
                off_policy |= apply_tis(rows, cfg.algo.tis_cap)

            # 5. update ---------------------------------------------------------------------------
            update = policy_update(policy, critic, rows, run.optimizer, run.scheduler, run.params, cfg, step, dist)
            t3 = time.perf_counter()

            # 6. publish: the next groups sample from the new policy (with k > 0 from the next token on)
            transfer = run.publish()
            t4 = time.perf_counter()

            # 7. log, validate, checkpoint ---------------------------------------------------------
            metrics = {"step": step + 1, **_rollout_metrics(trajs), **update, **off_policy, **transfer}
            if busy is not None:  # the share of the step the rollout engine ran no forward pass
                metrics["time/engine_idle_frac"] = 1 - (engine_busy_s(run.rollout.engine) - busy) / max(t4 - t0, 1e-9)
            metrics |= rollout_metrics | {  # what the producer left out, how stale the rest was
                "trained_episodes": len(train_trajs),
                "zero_variance_groups": len(zero_var) / max(1, len(set(groups))),
                "kl_in_reward": kl_reward,
                "lr": run.scheduler.get_last_lr()[0],
                "time/rollout": t1 - t0,
                "time/reference": t2 - t1,
                "time/update": t3 - t2,
                "time/weight_sync": t4 - t3,
                "time/step": t4 - t0,
                "time/trainer_idle_frac": (t1 - t0) / max(t4 - t0, 1e-9),  # waiting for trajectories
                "tokens_per_s/update": update["train_tokens"] / max(t3 - t2, 1e-9),
            }
            history.append(_end_step(cfg, run, step, metrics))
            bar.update(task_bar, advance=1, description=_describe(metrics))
    _finish(cfg, run)
    return history


def _end_step(cfg: TrainConfig, run: Run, step: int, metrics: dict[str, float]) -> dict[str, float]:
    """The curriculum's move, health, validation, logs and the checkpoint of a finished step."""
    if run.curriculum:  # mastered: the next steps draw the next value's tasks
        if run.curriculum.update(metrics["accuracy"]):
            run.rollout.switch(*run.stage(run.curriculum.task))
            run.console.print(f"curriculum: task.{cfg.curriculum.option}={run.curriculum.value} from step {step + 2}")
        metrics["curriculum/stage"] = run.curriculum.stage
    metrics |= run.health.update(metrics)
    if run.validator and ((step + 1) % cfg.val.every == 0 or step + 1 == cfg.steps):
        metrics |= run.validator(step + 1)
    if run.loggers:
        run.loggers.log(metrics, step + 1)
    if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
        state = run.rollout.state()  # the position it will start next, and the groups started but not trained
        extra = {"cursor": state.get("cursor"), "config": to_dict(cfg), "producer": state, "task": run.info["task"]}
        extra |= {"best": run.validator.best if run.validator else None}  # a resumed run keeps its best step
        extra |= {"curriculum": run.curriculum.state()} if run.curriculum else {}
        save_checkpoint(
            run.run_dir, step + 1, run.modules, run.optimizer, run.scheduler, extra, cfg.keep_last, run.dist
        )
    return metrics


def _finish(cfg: TrainConfig, run: Run) -> None:
    """After the last step (the run has stopped its producer and engines): rank 0 plots and exports."""
    if run.dist.main:
        plot_metrics(read_metrics(run.run_dir), run.run_dir / "plots" / "curves.png", title=str(run.run_dir))
        if not (run.validator and cfg.val.keep_best):  # with keep_best, policy/ already holds the best step
            export_policy(run.plain, run.processor, run.run_dir / "policy", info=run.info | {"step": cfg.steps})
    run.dist.close()  # no rank leaves before rank 0 has exported; then the process group ends cleanly


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
