"""Training-health diagnostics: notice early, from the metrics alone, that an agent RL run is going wrong.

Every step the monitor looks at the metric history and sets `health/<check>` to 1 or 0 in that step's
metrics; the first time a check fires it prints one warning that says what it means and what to try.
Trends compare the mean of the last `window` steps with the mean of the first `window` steps (the
baseline), so a check that needs a trend waits for 2 x window steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

Metrics = dict[str, float]


@dataclass
class HealthConfig:
    enabled: bool = True
    """compute the diagnostics every step and warn once per problem"""
    window: int = 3
    """steps averaged for the baseline (first steps) and for the recent value (last steps)"""
    tool_call_floor: float = 0.05
    """tool calls per episode at or below which the policy counts as no longer calling tools"""
    format_error_rise: float = 0.25
    """rise of format errors per episode over the baseline that counts as format collapse"""
    repetition_rise: float = 0.2
    """rise of across-sample repetition over the baseline that (with the two drops) is an echo trap"""
    echo_drop: float = 0.5
    """echo trap: entropy and reward std fell below this fraction of their baseline"""
    drift_mean: float = 1e-3
    """mean |rollout - trainer log-prob| over sampled tokens above which the ratio is untrustworthy"""
    drift_max: float = 0.1
    """max |rollout - trainer log-prob| of one token above which the ratio is untrustworthy"""
    zero_variance: float = 0.5
    """share of groups with equal rewards (no GRPO signal) above which learning stalls"""
    truncation: float = 0.2
    """share of episodes cut by max_new_tokens or the context window that is too high"""
    errors: float = 0.0
    """share of episodes that ended in an error (env or engine exception) above which to warn"""
    context_overflow: float = 0.0
    """share of episodes whose prompt outgrew the model's context window above which to warn"""


def _mean(history: list[Metrics], key: str, last: bool, n: int) -> float | None:
    part = history[-n:] if last else history[:n]
    values = [m[key] for m in part if key in m]
    return sum(values) / len(values) if values else None


def _trend(history: list[Metrics], key: str, n: int) -> tuple[float, float] | None:
    """(baseline, recent) of `key` once the first and last `n` steps no longer overlap."""
    if len(history) < 2 * n:
        return None
    base, recent = _mean(history, key, False, n), _mean(history, key, True, n)
    return None if base is None or recent is None else (base, recent)


def format_collapse(history: list[Metrics], cfg: HealthConfig) -> str | None:
    """Tool calls fall to ~zero, or format errors rise: the policy is unlearning the call format."""
    calls = _trend(history, "tool_calls", cfg.window)
    if calls and calls[0] > cfg.tool_call_floor >= calls[1]:
        return (
            f"tool calls per episode fell from {calls[0]:.2f} to {calls[1]:.2f}: the policy stopped using its "
            "tools. Lower the learning rate, add a format reward (format_weight) or a KL term (algo.kl_coef)."
        )
    errors = _trend(history, "format_errors", cfg.window)
    if errors and errors[1] - errors[0] > cfg.format_error_rise:
        return (
            f"format errors per episode rose from {errors[0]:.2f} to {errors[1]:.2f}: tool calls are breaking. "
            "Lower the learning rate or add a format reward (format_weight) / KL term (algo.kl_coef)."
        )
    return None


def echo_trap(history: list[Metrics], cfg: HealthConfig) -> str | None:
    """Samples converge on one template while entropy and reward variance fall (RAGEN's Echo Trap,
    Wang et al. 2025, arXiv 2504.20073): the policy reinforces its own narrow pattern."""
    rep = _trend(history, "repetition", cfg.window)
    ent = _trend(history, "entropy", cfg.window)
    std = _trend(history, "reward_std", cfg.window)
    if not (rep and ent and std):
        return None
    if rep[1] - rep[0] > cfg.repetition_rise and ent[1] < cfg.echo_drop * ent[0] and std[1] < cfg.echo_drop * std[0]:
        return (
            f"echo trap: samples repeat more ({rep[0]:.2f} -> {rep[1]:.2f}) while entropy ({ent[0]:.3f} -> "
            f"{ent[1]:.3f}) and reward std ({std[0]:.3f} -> {std[1]:.3f}) collapse. Lower the learning rate, "
            "raise the temperature or add an entropy bonus (algo.entropy_coef), filter zero-variance groups."
        )
    return None


def logprob_drift(history: list[Metrics], cfg: HealthConfig) -> str | None:
    """Rollout and trainer log-probs of the same tokens disagree before any update (the log-prob
    consistency guard rail, docs/architecture.md)."""
    m = history[-1]
    mean, top = m.get("logprob_drift_mean"), m.get("logprob_drift_max")
    if mean is None or top is None or (mean <= cfg.drift_mean and top <= cfg.drift_max):
        return None
    if "tis_weight_mean" in m:  # the trainer recomputed the old log-probs: TIS corrects what is left
        return (
            f"rollout vs trainer log-prob drift: mean |d| {mean:.2e}, max {top:.2e}; truncated IS weights these "
            f"tokens (mean weight {m['tis_weight_mean']:.3f}, {m.get('tis_clip_frac', 0):.1%} at algo.tis_cap). "
            "Expected with bf16 or another engine's kernels; if it grows, check the engine's dtype and weight sync."
        )
    return (
        f"rollout vs trainer log-prob drift: mean |d| {mean:.2e}, max {top:.2e} before any update. The importance "
        "ratio is off: check the engine's dtype and temperature, masks and chat-template re-rendering."
    )


def zero_variance(history: list[Metrics], cfg: HealthConfig) -> str | None:
    """Most groups got equal rewards: group-relative estimators have no signal there."""
    share = history[-1].get("zero_variance_groups")
    if share is None or share <= cfg.zero_variance:
        return None
    return (
        f"{share:.0%} of groups have equal rewards and give no learning signal: the tasks are too easy or too "
        "hard for the policy. Use larger groups, a task mix closer to the policy's level, or a process reward."
    )


def truncation(history: list[Metrics], cfg: HealthConfig) -> str | None:
    """Many episodes cut by the token or context budget: their rewards measure the budget, not the policy."""
    share = history[-1].get("truncated")
    if share is None or share <= cfg.truncation:
        return None
    return (
        f"{share:.0%} of episodes were truncated (max_new_tokens or the context window). Raise "
        "rollout.max_new_tokens, shorten the prompt, or penalise rambling."
    )


OVERFLOW_REMEDY = (
    "Use a model with a longer context, or keep every prompt within a budget: task.context.strategy="
    "truncate|elide|summarize|memory with task.context.budget=N (docs/context.md)."
)


def context_overflow(history: list[Metrics], cfg: HealthConfig) -> str | None:
    """Episodes that ended because the next prompt no longer fit the context window score 0 for a reason
    the policy did not choose (τ²'s telecom prompt alone outgrows SmolLM2's 8k before the first turn)."""
    share = history[-1].get("termination/context_overflow")
    if share is None or share <= cfg.context_overflow:
        return None
    return f"{share:.0%} of episodes ended in a context overflow: the prompt outgrew the window. {OVERFLOW_REMEDY}"


def episode_errors(history: list[Metrics], cfg: HealthConfig) -> str | None:
    """Episodes that ended in an exception (env, tool host or engine): they are left out of the update,
    so a high share means the run trains on a biased few, or on nothing."""
    share = history[-1].get("termination/error")
    if share is None or share <= cfg.errors:
        return None
    return (
        f"{share:.0%} of episodes ended in an error and were not trained on (see `error` in the trajectory "
        "records, agent-r1 view RUN_DIR). Check the env, its data file and the engine."
    )


def nonfinite(history: list[Metrics], cfg: HealthConfig) -> str | None:
    """NaN/inf in a loss, a gradient or any metric."""
    m = history[-1]
    bad = sorted(k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v))
    if m.get("skipped_nonfinite", 0) > 0 or bad:
        where = f" ({', '.join(bad[:4])})" if bad else ""
        return (
            f"non-finite values this step{where}; {int(m.get('skipped_nonfinite', 0))} update(s) were skipped. "
            "Check the reward function for NaN and lower the learning rate."
        )
    return None


CHECKS: dict[str, Callable[[list[Metrics], HealthConfig], str | None]] = {
    "format_collapse": format_collapse,
    "echo_trap": echo_trap,
    "logprob_drift": logprob_drift,
    "zero_variance": zero_variance,
    "truncation": truncation,
    "context_overflow": context_overflow,
    "errors": episode_errors,
    "nonfinite": nonfinite,
}


class HealthMonitor:
    """Runs every check on each step's metrics; warns once per check."""

    def __init__(self, cfg: HealthConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.history: list[Metrics] = []
        self.warned: set[str] = set()

    def update(self, metrics: Metrics) -> Metrics:
        """`health/<check>` = 1.0 where a check fires on the history including `metrics`, else 0.0."""
        if not self.cfg.enabled:
            return {}
        self.history.append(metrics)
        flags = {}
        for name, check in CHECKS.items():
            message = check(self.history, self.cfg)
            flags[f"health/{name}"] = float(message is not None)
            if message and name not in self.warned:
                self.warned.add(name)
                self.console.print(f"[yellow]health warning (step {metrics.get('step', '?')}):[/] {message}")
        return flags
