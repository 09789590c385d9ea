"""Each diagnostic fires on a metric stream that should trigger it and stays silent on a healthy one."""

import io
import math

import pytest
from rich.console import Console

from agent_r1.observe.health import CHECKS, HealthConfig, HealthMonitor


def healthy(step: int) -> dict[str, float]:
    """A run that is learning: reward up, tools used, entropy and variance roughly stable."""
    return {
        "step": step,
        "reward_mean": 0.3 + 0.02 * step,
        "reward_std": 0.40,
        "tool_calls": 1.2,
        "format_errors": 0.05,
        "repetition": 0.10,
        "entropy": 0.80 - 0.005 * step,
        "logprob_drift_mean": 2e-6,
        "logprob_drift_max": 3e-5,
        "zero_variance_groups": 0.25,
        "truncated": 0.05,
        "skipped_nonfinite": 0,
        "loss": 0.01,
    }


def run(stream: list[dict[str, float]]) -> tuple[list[dict[str, float]], str]:
    out = io.StringIO()
    monitor = HealthMonitor(HealthConfig(), Console(file=out, width=400))
    flags = [monitor.update(m) for m in stream]
    return flags, out.getvalue()


def with_changes(n: int, start: int, **late: float) -> list[dict[str, float]]:
    """A healthy stream of n steps whose metrics take the `late` values from step `start` on."""
    return [healthy(s) | (late if s >= start else {}) for s in range(1, n + 1)]


def test_healthy_run_is_silent():
    flags, printed = run([healthy(s) for s in range(1, 13)])
    assert all(v == 0.0 for f in flags for v in f.values())
    assert set(flags[-1]) == {f"health/{name}" for name in CHECKS}
    assert printed == ""


@pytest.mark.parametrize(
    ("check", "late", "words"),
    [
        ("format_collapse", {"tool_calls": 0.0}, "stopped using its tools"),
        ("format_collapse", {"format_errors": 0.6}, "format errors per episode rose"),
        ("echo_trap", {"repetition": 0.8, "entropy": 0.2, "reward_std": 0.05}, "echo trap"),
        ("logprob_drift", {"logprob_drift_mean": 0.02, "logprob_drift_max": 0.9}, "drift"),
        ("logprob_drift", {"logprob_drift_max": 0.5}, "drift"),  # one badly wrong token is enough
        (  # vLLM / bf16: old log-probs recomputed, the warning says what TIS does with the gap
            "logprob_drift",
            {"logprob_drift_mean": 0.02, "tis_weight_mean": 0.97, "tis_clip_frac": 0.004},
            "mean weight 0.970, 0.4% at algo.tis_cap",
        ),
        ("zero_variance", {"zero_variance_groups": 0.9}, "equal rewards"),
        ("truncation", {"truncated": 0.5}, "truncated"),
        ("nonfinite", {"skipped_nonfinite": 1}, "non-finite"),
        ("nonfinite", {"loss": math.nan}, "loss"),
    ],
)
def test_each_diagnostic_fires_and_warns_once(check, late, words):
    flags, printed = run(with_changes(12, 5, **late))
    fired = [f[f"health/{check}"] for f in flags]
    assert fired[-1] == 1.0 and fired[:4] == [0.0] * 4  # fires on the bad steps, not on the healthy start
    others = {k for f in flags for k, v in f.items() if v and k != f"health/{check}"}
    assert not others, f"only {check} should fire, also fired: {others}"
    assert printed.count("health warning") == 1 and words in printed


def test_echo_trap_needs_all_three_signs():
    """Samples agreeing more is fine when entropy and reward variance hold (the policy just got good)."""
    flags, _ = run(with_changes(12, 5, repetition=0.8))
    assert all(f["health/echo_trap"] == 0.0 for f in flags)
    flags, _ = run(with_changes(12, 5, repetition=0.8, entropy=0.2))
    assert all(f["health/echo_trap"] == 0.0 for f in flags)


def test_trends_wait_for_a_baseline():
    """A run that starts without tool calls has not collapsed: there is nothing to fall from."""
    flags, printed = run([healthy(s) | {"tool_calls": 0.0} for s in range(1, 10)])
    assert all(f["health/format_collapse"] == 0.0 for f in flags) and printed == ""


def test_disabled_monitor_adds_nothing():
    monitor = HealthMonitor(HealthConfig(enabled=False), Console(file=io.StringIO()))
    assert monitor.update(healthy(1) | {"skipped_nonfinite": 3}) == {}


def test_episodes_that_overflow_the_context_are_warned_about_with_the_remedy():
    from agent_r1.observe.health import HealthConfig, context_overflow

    assert context_overflow([{"termination/context_overflow": 0.0}], HealthConfig()) is None
    message = context_overflow([{"termination/context_overflow": 0.25}], HealthConfig())
    assert message.startswith("25% of episodes ended in a context overflow") and "task.context.budget" in message
