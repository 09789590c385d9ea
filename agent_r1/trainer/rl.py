"""`agent-r1 train`: the RL loop, readable top to bottom.

    for each step:
      1. rollout      AgentEnvLoop + LocalEngine (same model object: no weight sync, no second copy)
      2. rewards      per step: process rewards (weighted, optionally PRIME-normalised) + outcome
      3. rows         merged steps -> packed rows; reference log-probs (KL) and values (PPO)
      4. advantages   one estimator from agent_r1.algos.advantages, broadcast to sampled tokens
      5. update       epochs x mini-batches x packed micro-batches, clipped policy loss (+KL, +value)
      6. metrics      one line per step (JSONL, TensorBoard, W&B), health checks, trajectory records
      7. checkpoint   atomic, exact resume

The importance ratio uses the rollout log-probs (the engine computes them with the same weights and
temperature), so there is no extra "old log-prob" forward pass; the log-prob consistency test is what
makes that safe.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

from agent_r1.algos import advantages as adv_fns
from agent_r1.algos.losses import aggregate, gspo_policy_loss, kl_penalty, ppo_policy_loss, value_loss
from agent_r1.config import to_dict
from agent_r1.env.base import Env
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.evaluate import evaluate
from agent_r1.models.loading import is_chat_model, load_model
from agent_r1.models.lora import with_lora
from agent_r1.models.onednn import use_onednn
from agent_r1.observe.health import HealthMonitor
from agent_r1.observe.loggers import Loggers
from agent_r1.observe.plot import plot_metrics, read_metrics
from agent_r1.observe.records import step_path, trajectory_records, write_records
from agent_r1.recipes import recipe_tasks, tasks_and_env
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.rollout.engine import SamplingParams
from agent_r1.rollout.local_engine import LocalEngine
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.trainer.batching import MicroBatch, Row, pack, token_logprobs
from agent_r1.trainer.checkpoint import export_policy, latest_checkpoint, load_checkpoint, save_checkpoint
from agent_r1.trainer.common import adamw, lr_schedule, progress_bar
from agent_r1.trainer.config import TrainConfig
from agent_r1.types import Trajectory

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")


def train(
    cfg: TrainConfig,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    make_env: Callable[[], Env] | None = None,
    tasks: list[dict[str, Any]] | None = None,
    console: Console | None = None,
) -> list[dict[str, float]]:
    """Run RL from `cfg`; `model`/`tokenizer`/`make_env`/`tasks` override the config's recipe."""
    console = console or Console()
    if tasks is not None and cfg.val.every and not cfg.val.data:  # fail before any model loads
        raise ValueError("val.every is set and the training tasks were passed in: give val.data (validation jsonl)")
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    # --- model, reference, critic, optimizer -------------------------------------------------------
    if model is None:
        model, tokenizer = load_model(cfg.model)
    use_onednn(model)  # a model passed in gets the same kernels as a loaded one (no-op if it has them)
    policy = with_lora(model, cfg.lora) if cfg.lora.enabled else model
    ref = _reference(policy, cfg)
    critic = Critic(policy, cfg.algo.critic) if cfg.algo.estimator == "ppo" else None
    modules: dict[str, torch.nn.Module] = {"policy": policy} | ({"critic": critic} if critic else {})
    params = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
    params = list({id(p): p for p in params}.values())  # the head critic shares the policy backbone
    optimizer = adamw(params, cfg.optim.lr, cfg.optim.weight_decay)
    total_updates = cfg.steps * cfg.algo.epochs * cfg.algo.mini_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_schedule(total_updates, cfg.optim.warmup_steps, cfg.optim.schedule)
    )

    # --- tasks and environment ---------------------------------------------------------------------
    chat = is_chat_model(cfg.model, tokenizer) if cfg.prompt_format == "auto" else cfg.prompt_format == "chat"
    fmt = prompt_format_for(tokenizer, chat=chat)
    train_tasks, recipe_env = tasks_and_env(
        cfg.recipe, fmt, split="train", n=4096, seed=cfg.seed, ops=cfg.ops, data=cfg.data,
        max_turns=cfg.rollout.max_turns, few_shot=cfg.few_shot, format_weight=cfg.format_weight,
        retriever=cfg.retriever, max_tool_tokens=cfg.max_tool_tokens,
    )  # fmt: skip
    tasks = tasks if tasks is not None else train_tasks
    make_env = make_env or recipe_env
    sampler = TaskSampler(tasks, cfg.seed)
    engine = LocalEngine(policy, tokenizer, max_batch_size=cfg.rollout.max_batch_size, seed=cfg.seed)

    validator = Validator(cfg, engine, make_env, policy, tokenizer, console) if cfg.val.every else None

    start = 0
    if cfg.resume and (ckpt := latest_checkpoint(run_dir)) is not None:
        meta = load_checkpoint(ckpt, modules, optimizer, scheduler)
        start, sampler.cursor = meta["step"], meta["cursor"]
        if validator and validator.metric in (meta.get("best") or {}):  # the same metric as the saved best
            validator.best = meta["best"]
        console.print(f"resumed from {ckpt} (step {start})")

    loggers = Loggers(cfg.log, run_dir, to_dict(cfg))
    health = HealthMonitor(cfg.health, console)
    history = []
    if validator and start == 0:  # the starting policy is a candidate too: RL must beat it to be kept
        history.append({"step": 0} | validator(0))
        loggers.log(history[-1], 0)
    with progress_bar(console) as bar:
        task_bar = bar.add_task("RL steps", total=cfg.steps, completed=start)
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()

            # 1. rollout -------------------------------------------------------------------------------
            policy.eval()
            loop = AgentEnvLoop(engine, make_env, cfg.rollout.sampling(), seed=cfg.seed * 1_000_003 + step)
            trajs = loop.run_sync(sampler.take(cfg.rollout.tasks_per_step), cfg.rollout.group_size)
            t1 = time.perf_counter()

            # 2. rewards ----------------------------------------------------------------------------
            step_rewards = shape_rewards(trajs, cfg)  # list over trajectories of [K_i]

            # 3. rows, reference log-probs, values -------------------------------------------------
            rows, where = build_rows(trajs, step_rewards)
            kl_reward = 0.0
            if ref is not None and cfg.algo.kl_mode == "reward":  # the KL is part of every return
                _fill_ref_logprobs(ref, rows, cfg)
                kl_reward = _subtract_kl_from_rewards(rows, where, step_rewards, cfg)
            zero_var = _zero_variance_groups(trajs, step_rewards)
            skip = cfg.algo.zero_variance_groups == "skip" and cfg.algo.estimator in GROUP_ESTIMATORS
            trained = [not (skip and trajs[t].group_id in zero_var) for t in where.row_owner]
            if ref is not None and cfg.algo.kl_mode == "loss":  # only rows the update will see need one
                _fill_ref_logprobs(ref, [r for r, keep in zip(rows, trained, strict=True) if keep], cfg)
            if critic is not None:
                _fill_old_values(critic, policy, rows, cfg)
            t2 = time.perf_counter()

            # 4. advantages -------------------------------------------------------------------------
            _fill_advantages(rows, where, trajs, step_rewards, cfg)
            if cfg.log.trajectories_every and (step + 1) % cfg.log.trajectories_every == 0:
                _write_trajectories(run_dir, step + 1, trajs, rows, where, tokenizer)
            rows = [r for r, keep in zip(rows, trained, strict=True) if keep]

            # 5. update -----------------------------------------------------------------------------
            update = _update(policy, critic, ref, rows, optimizer, scheduler, params, cfg, step)
            t3 = time.perf_counter()

            # 6. metrics ----------------------------------------------------------------------------
            metrics = {"step": step + 1, **_rollout_metrics(trajs), **update}
            metrics |= {
                "zero_variance_groups": len(zero_var) / max(1, len({t.group_id for t in trajs})),
                "kl_in_reward": kl_reward,
                "lr": scheduler.get_last_lr()[0],
                "time/rollout": t1 - t0,
                "time/reference": t2 - t1,
                "time/update": t3 - t2,
                "time/step": t3 - t0,
                "tokens_per_s/update": update["train_tokens"] / max(t3 - t2, 1e-9),
            }
            metrics |= health.update(metrics)
            if validator and ((step + 1) % cfg.val.every == 0 or step + 1 == cfg.steps):
                metrics |= validator(step + 1)
            loggers.log(metrics, step + 1)
            history.append(metrics)
            bar.update(task_bar, advance=1, description=_describe(metrics))

            # 7. checkpoint -------------------------------------------------------------------------
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                best = validator.best if validator else None  # a resumed run keeps its best step
                extra = {"cursor": sampler.cursor, "config": to_dict(cfg), "best": best}
                save_checkpoint(run_dir, step + 1, modules, optimizer, scheduler, extra, keep=cfg.keep_last)

    loggers.close()
    plot_metrics(read_metrics(run_dir), run_dir / "plots" / "curves.png", title=str(run_dir))
    if not (validator and cfg.val.keep_best):  # with keep_best, policy/ already holds the best step
        export_policy(policy, tokenizer, run_dir / "policy")
    return history


# --- 2. rewards -----------------------------------------------------------------------------------


def shape_rewards(trajs: list[Trajectory], cfg: TrainConfig) -> list[torch.Tensor]:
    """Per-step rewards: the last step's reward is the outcome, earlier ones are process rewards.

    Process rewards are scaled by `process_reward_weight` and, with `process_reward_norm`, first
    divided by the batch max of |reverse cumulative sum| (PRIME, as in Agent-R1). See docs/rewards.md.
    """
    process = [torch.tensor([*t.rewards[:-1], 0.0], dtype=torch.float64) for t in trajs]  # [K_i]
    if cfg.algo.process_reward_norm:
        process = adv_fns.normalize_process_rewards(process)
    out = []
    for t, p in zip(trajs, process, strict=True):
        r = cfg.algo.process_reward_weight * p
        if t.steps:
            r[-1] += t.rewards[-1]
        out.append(r.float())
    return out


# --- 3. rows ---------------------------------------------------------------------------------------


@dataclass
class RowIndex:
    """Where each trajectory's steps live among the rows (a trajectory may span several rows)."""

    row_owner: list[int]  # per row: index of its trajectory
    step_index: list[torch.Tensor]  # per row [T]: step that sampled the token, -1 elsewhere
    step_tokens: list[torch.Tensor]  # per trajectory [K_i]: sampled tokens of each step


def build_rows(trajs: list[Trajectory], step_rewards: list[torch.Tensor]) -> tuple[list[Row], RowIndex]:
    """Merged training rows of every trajectory, with one segment id per step response."""
    rows, owners, step_idx = [], [], []
    seg_base = 0
    for ti, t in enumerate(trajs):
        for seq in merge_trajectory(t):
            sidx = torch.tensor(seq.step_index)
            seg = torch.where(sidx >= 0, seg_base + sidx, -1)
            rows.append(
                Row(
                    input_ids=torch.tensor(seq.input_ids),
                    mask=torch.tensor(seq.loss_mask, dtype=torch.float32),
                    old_logp=torch.tensor(seq.logprobs, dtype=torch.float32),
                    adv=torch.zeros(len(seq.input_ids)),
                    seg=seg,
                )
            )
            owners.append(ti)
            step_idx.append(sidx)
        seg_base += len(t.steps)
    step_tokens = [torch.tensor([len(s.response_ids) for s in t.steps], dtype=torch.float32) for t in trajs]
    return rows, RowIndex(owners, step_idx, step_tokens)


@torch.no_grad()
def _fill_ref_logprobs(ref: Callable, rows: list[Row], cfg: TrainConfig) -> None:
    """Reference-policy log-probs of every row, batched like the update (shared prefixes once)."""
    with ref() as model:
        for mb in pack(rows, cfg.optim.micro_batch_tokens):
            logp = token_logprobs(model, mb, cfg.rollout.temperature)[0]
            for row, part in zip(mb.rows, logp.split(mb.row_lens), strict=True):
                row.ref_logp = part


def _subtract_kl_from_rewards(rows: list[Row], where: RowIndex, step_rewards: list[torch.Tensor], cfg) -> float:
    """kl_mode=reward: each step's reward -= kl_coef * sum of its tokens' KL estimates."""
    total = 0.0
    for row, ti, sidx in zip(rows, where.row_owner, where.step_index, strict=True):
        kl = kl_penalty(row.old_logp, row.ref_logp, cfg.algo.kl_estimator) * row.mask  # [T]
        for k in sidx[sidx >= 0].unique().tolist():
            penalty = cfg.algo.kl_coef * float(kl[sidx == k].sum())
            step_rewards[ti][k] -= penalty
            total += penalty
    return total / max(1, len(step_rewards))


# --- 4. advantages ---------------------------------------------------------------------------------


def _fill_advantages(rows: list[Row], where: RowIndex, trajs, step_rewards, cfg: TrainConfig) -> None:
    """Per-step (or per-token) advantages from the configured estimator, written into rows."""
    a = cfg.algo
    groups = [t.group_id for t in trajs]
    if a.estimator == "ppo":
        _fill_gae(rows, where, step_rewards, cfg)
        return
    if a.estimator in ("grpo", "drgrpo"):
        step_adv = adv_fns.grpo(step_rewards, groups, norm_by_std=a.estimator == "grpo")
    elif a.estimator == "rloo":
        step_adv = adv_fns.rloo(step_rewards, groups)
    elif a.estimator == "reinforce_pp":
        step_adv = adv_fns.reinforce_pp(step_rewards, where.step_tokens, a.gamma)
    else:
        step_adv = adv_fns.reinforce_pp_baseline(step_rewards, where.step_tokens, groups, a.gamma)
    for row, ti, sidx in zip(rows, where.row_owner, where.step_index, strict=True):
        row.adv = adv_fns.token_advantages([step_adv[ti]], sidx, torch.zeros_like(sidx)).float()


def _fill_gae(rows: list[Row], where: RowIndex, step_rewards: list[torch.Tensor], cfg: TrainConfig) -> None:
    """PPO: GAE over steps (value of the state before each step) or over sampled tokens."""
    a = cfg.algo
    n = len(step_rewards)
    by_traj: list[list[tuple[Row, torch.Tensor]]] = [[] for _ in range(n)]
    for row, ti, sidx in zip(rows, where.row_owner, where.step_index, strict=True):
        by_traj[ti].append((row, sidx))
    for ti, parts in enumerate(by_traj):
        if not parts:
            continue
        if a.gae_level == "step":
            values = torch.zeros(len(step_rewards[ti]))  # [K]
            for row, sidx in parts:
                for k in sidx[sidx >= 0].unique().tolist():
                    first = int((sidx == k).nonzero()[0])
                    values[k] = row.old_values[first]
            (adv,), (ret,) = adv_fns.gae([step_rewards[ti]], [values], a.gamma, a.lam)
            for row, sidx in parts:
                row.adv = adv_fns.token_advantages([adv], sidx, torch.zeros_like(sidx)).float()
                row.returns = torch.zeros(len(sidx))
                for k in sidx[sidx >= 0].unique().tolist():
                    row.returns[int((sidx == k).nonzero()[0])] = ret[k]
        else:
            token_r = adv_fns.rewards_on_last_token([step_rewards[ti]], [where.step_tokens[ti]])[0]  # [S]
            values = torch.cat([row.old_values[row.mask.bool()] for row, _ in parts])  # [S]
            (adv,), (ret,) = adv_fns.gae([token_r], [values], a.gamma, a.lam)
            offset = 0
            for row, _ in parts:
                pos = row.mask.nonzero().squeeze(-1)
                row.adv = torch.zeros(len(row.mask)).index_put((pos,), adv[offset : offset + len(pos)].float())
                row.returns = torch.zeros(len(row.mask)).index_put((pos,), ret[offset : offset + len(pos)].float())
                offset += len(pos)


def _zero_variance_groups(trajs: list[Trajectory], step_rewards: list[torch.Tensor]) -> set[str]:
    """Groups (of >= 2 samples) whose episode returns are all equal: no group-relative signal."""
    returns: dict[str, list[float]] = {}
    for t, r in zip(trajs, step_rewards, strict=True):
        returns.setdefault(t.group_id, []).append(round(float(r.sum()), 6))
    return {g for g, rs in returns.items() if len(rs) > 1 and len(set(rs)) == 1}


# --- 5. update -------------------------------------------------------------------------------------


def _update(policy, critic, ref, rows, optimizer, scheduler, params, cfg: TrainConfig, step: int) -> dict[str, float]:
    """Epochs x mini-batches of packed micro-batches; non-finite losses or gradients skip the step."""
    a, o = cfg.algo, cfg.optim
    stats: dict[str, list[float]] = {}
    skipped = 0
    train_tokens = 0
    if not rows:
        return {"train_tokens": 0, "skipped_nonfinite": 0, "updates": 0}
    policy.train()
    norm_len = float(cfg.rollout.max_new_tokens * cfg.rollout.max_turns)
    policy_loss_fn = gspo_policy_loss if a.policy_loss == "gspo" else ppo_policy_loss
    updates = 0
    drift: list[torch.Tensor] = []  # |trainer - rollout| log-prob of sampled tokens, before any update
    for epoch in range(a.epochs):
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed * 7919 + step * 31 + epoch))
        for mini in order.chunk(a.mini_batches):
            batch = [rows[i] for i in mini.tolist()]
            n_tokens = float(sum(r.mask.sum() for r in batch))
            n_seqs = float(sum(len(r.seg[r.mask.bool()].unique()) for r in batch))
            if n_tokens == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for mb in pack(batch, o.micro_batch_tokens):
                agg = {"mode": a.loss_agg, "n_tokens": n_tokens, "n_seqs": n_seqs, "norm_len": norm_len}
                logp, entropy, hidden = token_logprobs(
                    policy,
                    mb,
                    cfg.rollout.temperature,
                    entropy=True,
                    entropy_grad=a.entropy_coef > 0,
                    hidden=critic is not None and critic.shared,
                )
                loss, m = policy_loss_fn(
                    logp, mb.old_logp, mb.adv, mb.mask, mb.seg, clip_low=a.clip_low, clip_high=a.clip_high,
                    dual_clip=a.dual_clip, agg=a.loss_agg, n_tokens=n_tokens, n_seqs=n_seqs, norm_len=norm_len,
                )  # fmt: skip
                if ref is not None and a.kl_mode == "loss" and a.kl_coef > 0:
                    kl_tok = kl_penalty(logp, mb.ref_logp, a.kl_estimator)  # [L]
                    loss = loss + a.kl_coef * aggregate(kl_tok, mb.mask, mb.seg, **agg)
                    m["kl"] = float((kl_tok.detach() * mb.mask).sum() / mb.mask.sum().clamp(min=1))
                if a.entropy_coef > 0:
                    loss = loss - a.entropy_coef * aggregate(entropy, mb.mask, mb.seg, **agg)
                if critic is not None:
                    vl, vm = value_loss(
                        critic(mb, hidden),
                        mb.old_values,
                        mb.returns,
                        _value_mask(mb, a.gae_level),
                        mb.seg,
                        clip=a.value_clip,
                        agg="token-mean",
                        n_tokens=n_tokens if a.gae_level == "token" else n_seqs,
                    )  # fmt: skip (value targets: every sampled token, or each step's first one = one per segment)
                    loss = loss + a.vf_coef * vl
                    m |= vm | {"value_loss": vl.item()}
                if updates == 0:  # weights are still the rollout's: any difference is drift, not learning
                    drift.append((logp.detach() - mb.old_logp)[mb.mask > 0].abs())
                if not torch.isfinite(loss):
                    finite = False
                    break
                loss.backward()
                train_tokens += mb.num_tokens
                m["entropy"] = float((entropy.detach() * mb.mask).sum() / mb.mask.sum().clamp(min=1))
                for k, v in m.items():
                    stats.setdefault(k, []).append(float(v))
            grad_norm = torch.nn.utils.clip_grad_norm_(params, o.grad_clip) if finite else torch.tensor(math.nan)
            if not finite or not torch.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)  # never apply a NaN/inf update
                skipped += 1
                continue
            optimizer.step()
            scheduler.step()
            updates += 1
            stats.setdefault("grad_norm", []).append(float(grad_norm))
    policy.eval()
    out = {k: sum(v) / len(v) for k, v in stats.items() if v}
    if drift and (d := torch.cat(drift)).numel():
        out |= {"logprob_drift_mean": float(d.mean()), "logprob_drift_max": float(d.max())}
    return out | {"train_tokens": train_tokens, "skipped_nonfinite": skipped, "updates": updates}


def _value_mask(mb: MicroBatch, level: str) -> torch.Tensor:
    """Tokens that carry a value target: each step's first sampled token (step level) or all of them."""
    if level == "token":
        return mb.mask
    return (mb.mask.bool() & (torch.roll(mb.seg, 1) != mb.seg)).float()


# --- reference policy and critic ---------------------------------------------------------------------


def _reference(policy: torch.nn.Module, cfg: TrainConfig) -> Callable | None:
    """A context manager factory yielding the reference policy, or None when KL is off.

    With LoRA the reference is the same model with its adapters disabled (no second copy); with
    full fine-tuning it is a frozen copy of the initial weights.
    """
    if cfg.algo.kl_coef == 0:
        return None
    if cfg.lora.enabled:

        @contextlib.contextmanager
        def adapters_off():
            with policy.disable_adapter():
                yield policy

        return adapters_off
    frozen = copy.deepcopy(policy).eval().requires_grad_(False)
    return lambda: contextlib.nullcontext(frozen)


class Critic(torch.nn.Module):
    """PPO critic: a linear value head on the policy's last hidden state ("head": shared backbone)
    or on a separate copy of the model ("separate"). V for sampled token p is read at position p-1,
    i.e. the state before the token was chosen."""

    def __init__(self, policy: torch.nn.Module, kind: str) -> None:
        super().__init__()
        hidden = policy.config.hidden_size
        self.shared = kind == "head"
        self.backbone = None if self.shared else copy.deepcopy(policy)
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, mb: MicroBatch, policy_hidden: torch.Tensor | None) -> torch.Tensor:
        """Values aligned to targets: [L], V[p] read from the hidden state at p-1."""
        if self.shared:
            hidden = policy_hidden  # [L, H]
        else:
            out = self.backbone(
                input_ids=mb.input_ids[None], position_ids=mb.position_ids[None],
                output_hidden_states=True, use_cache=False, logits_to_keep=1,
            )  # fmt: skip
            hidden = out.hidden_states[-1][0]
        v = self.head(hidden.float()).squeeze(-1)  # [L] value of the state after each position
        return torch.cat([v.new_zeros(1), v[:-1]])  # [L]


@torch.no_grad()
def _fill_old_values(critic: Critic, policy: torch.nn.Module, rows: list[Row], cfg: TrainConfig) -> None:
    """Critic values at rollout time (the clipping anchor and the GAE baseline)."""
    for mb in pack(rows, cfg.optim.micro_batch_tokens):
        hidden = token_logprobs(policy, mb, cfg.rollout.temperature, hidden=True)[2] if critic.shared else None
        for row, part in zip(mb.rows, critic(mb, hidden).split(mb.row_lens), strict=True):
            row.old_values = part


# --- validation and best-checkpoint selection --------------------------------------------------------


class Validator:
    """Greedy evaluation on the validation split, and export of the best policy so far (by `val.metric`).

    Model selection on a split that is neither trained on nor reported (as in HF Trainer's
    `load_best_model_at_end`): RL curves are noisy and a policy can overshoot, e.g. learn a rule that
    helps the training mix and hurts another problem type, so the run keeps the step that validated
    best instead of whatever the last step happens to be. The held-out test split stays untouched.
    """

    def __init__(self, cfg: TrainConfig, engine, make_env: Callable[[], Env], policy, tokenizer, console) -> None:
        v = cfg.val
        self.tasks = recipe_tasks(cfg.recipe, split="val", n=v.num_tasks, seed=cfg.seed, ops=v.ops, data=v.data)
        self.make_env = make_env  # the training env: same tools, prompt and reward
        self.sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
        self.engine, self.policy, self.tokenizer, self.console = engine, policy, tokenizer, console
        self.out = Path(cfg.run_dir) / "policy" if v.keep_best else None
        self.records = Path(cfg.run_dir) / "val" if cfg.log.trajectories_every else None  # agent-r1 view RUN_DIR/val
        self.metric = v.metric
        self.best: dict[str, float] = {"step": -1, v.metric: -math.inf}

    def __call__(self, step: int) -> dict[str, float]:
        """Validate the current policy (after `step` RL steps); export it if it is the best so far."""
        self.policy.eval()
        metrics, trajs = evaluate(self.engine, self.make_env, self.tasks, self.sampling)
        if self.records is not None:
            write_records(step_path(self.records, step), trajectory_records(trajs, self.tokenizer, step=step))
        m = self.metric
        if m not in metrics:
            raise ValueError(f"val.metric={m!r} is not an eval metric; choose from {', '.join(sorted(metrics))}")
        value = metrics[m]
        if value > self.best[m]:
            self.best = {"step": step, m: value}
            if self.out is not None:
                export_policy(self.policy, self.tokenizer, self.out, extra={"best.json": json.dumps(self.best)})
        self.console.print(
            f"validation after step {step}: {m} {value:.3g} (best {self.best[m]:.3g} at step {self.best['step']})"
        )
        return {f"val/{k}": v for k, v in metrics.items()} | {"val/best_step": self.best["step"]}


# --- data, schedule, logging -----------------------------------------------------------------------


class TaskSampler:
    """Epoch-wise shuffled task order; `cursor` (tasks consumed) is all a resume needs."""

    def __init__(self, tasks: list[dict[str, Any]], seed: int) -> None:
        self.tasks, self.seed, self.cursor = tasks, seed, 0

    def take(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.cursor, len(self.tasks))
            order = random.Random(self.seed * 1_000_033 + epoch).sample(range(len(self.tasks)), len(self.tasks))
            out.append(self.tasks[order[pos]])
            self.cursor += 1
        return out


def _write_trajectories(run_dir: Path, step: int, trajs, rows: list[Row], where: RowIndex, tokenizer) -> None:
    """RUN_DIR/trajectories/step_N.jsonl.gz with each row's advantages (and reference log-probs)."""
    advs: list[list[torch.Tensor]] = [[] for _ in trajs]
    refs: list[list[torch.Tensor | None]] = [[] for _ in trajs]
    for row, ti in zip(rows, where.row_owner, strict=True):
        advs[ti].append(row.adv)
        refs[ti].append(row.ref_logp)
    records = trajectory_records(trajs, tokenizer, step=step, advantages=advs, ref_logprobs=refs)
    write_records(step_path(run_dir, step), records)


def _rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    m = summarize(trajs)
    rewards = torch.tensor([t.reward for t in trajs])
    outcome = [t.rewards[-1] if t.steps else 0.0 for t in trajs]
    accuracy = m.get("reward/correct", sum(o >= 1.0 for o in outcome) / max(1, len(trajs)))
    return m | {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(trajs) > 1 else 0.0,
        "accuracy": accuracy,
    }


def _describe(m: dict[str, float]) -> str:
    return f"RL step {m['step']}: reward {m['reward_mean']:.2f} acc {m['accuracy']:.0%} ({m['time/step']:.0f}s)"
