"""The RL loop on the toy task: learning, every estimator/loss combination, resume, NaN safety."""

import json

import pytest
import torch
from safetensors.torch import load_file

from agent_r1.rollout.producer import RolloutStalled
from agent_r1.trainer.checkpoint import latest_checkpoint
from agent_r1.trainer.rl import train
from agent_r1.types import Observation
from tests.trainer.conftest import TASKS, LowIdEnv, killed_after_logging, tiny_model, toy_config


def run(cfg, tokenizer, model=None, env=LowIdEnv):
    model = model or tiny_model()
    return model, train(cfg, model=model, tokenizer=tokenizer, make_env=env, tasks=TASKS)


def test_grpo_reward_rises(tmp_path, tokenizer):
    cfg = toy_config(tmp_path, "steps=12")
    _, hist = run(cfg, tokenizer)
    first, last = sum(h["reward_mean"] for h in hist[:3]) / 3, sum(h["reward_mean"] for h in hist[-3:]) / 3
    assert first < 0.6 and last > first + 0.2, [h["reward_mean"] for h in hist]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12
    row = json.loads(lines[-1])
    for key in (
        "reward_mean",
        "reward_std",
        "accuracy",
        "turns",
        "tool_calls",
        "tool_errors",
        "response_tokens",
        "entropy",
        "clip_frac",
        "grad_norm",
        "time/step",
        "tokens_per_s/update",
        "zero_variance_groups",
    ):
        assert key in row, key


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo.estimator=drgrpo", "algo.loss_agg=seq-mean-token-sum-norm"],
        ["algo.estimator=rloo", "algo.loss_agg=seq-mean-token-mean", "algo.dual_clip=3.0"],
        ["algo.estimator=reinforce_pp", "algo.gamma=0.9"],
        ["algo.estimator=reinforce_pp_baseline"],
        ["algo.estimator=gigpo", "algo.gamma=0.95", "algo.step_advantage_weight=0.5"],
        ["algo.estimator=turn_grpo", "algo.process_reward_potential=true"],
        ["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.loss_agg=seq-mean-token-mean"],
        ["algo.estimator=ppo", "algo.gae_level=step", "algo.epochs=2", "algo.mini_batches=2"],
        ["algo.estimator=ppo", "algo.gae_level=token", "algo.critic=separate"],
        ["algo.kl_coef=0.1", "algo.kl_mode=loss", "algo.kl_estimator=k3", "algo.entropy_coef=0.01"],
        ["algo.kl_coef=0.1", "algo.kl_mode=reward", "algo.kl_estimator=k1"],
        ["lora.enabled=true", "lora.r=4", "algo.kl_coef=0.1", "optim.schedule=cosine", "optim.warmup_steps=1"],
        ["optim.gradient_checkpointing=true", "algo.kl_coef=0.1"],
    ],
)
def test_every_estimator_and_loss_trains(tmp_path, tokenizer, overrides):
    cfg = toy_config(tmp_path, "steps=2", "algo.zero_variance_groups=keep", "optim.micro_batch_tokens=64", *overrides)
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, hist = run(cfg, tokenizer, model)
    assert all(h["skipped_nonfinite"] == 0 and h["updates"] >= 1 for h in hist)
    assert all(torch.isfinite(torch.tensor(h["grad_norm"])) for h in hist)
    if cfg.lora.enabled:  # adapters start with B = 0; training must move them
        changed = any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    else:
        changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert changed
    if cfg.algo.kl_coef and cfg.algo.kl_mode == "loss":
        assert hist[-1]["kl"] >= 0.0


def test_resume_is_exact(tmp_path, tokenizer):
    straight, _ = run(toy_config(tmp_path / "a", "steps=4", "save_every=2"), tokenizer)
    run(toy_config(tmp_path / "b", "steps=2", "save_every=2"), tokenizer)  # stops after step 2 ...
    resumed, hist = run(toy_config(tmp_path / "b", "steps=4", "save_every=2"), tokenizer)  # ... and resumes
    assert [h["step"] for h in hist] == [3, 4]
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    a = [json.loads(x)["reward_mean"] for x in (tmp_path / "a/run/metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x)["reward_mean"] for x in (tmp_path / "b/run/metrics.jsonl").read_text().splitlines()]
    assert a == b


def test_nan_reward_skips_the_update_and_keeps_weights_finite(tmp_path, tokenizer):
    cfg = toy_config(tmp_path, "steps=2", "algo.zero_variance_groups=keep")
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, hist = run(cfg, tokenizer, model, env=lambda: LowIdEnv(poison=True))
    assert all(h["skipped_nonfinite"] == 1 and h["updates"] == 0 for h in hist)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and torch.equal(p, before[n]), n


def test_checkpoints_keep_last_and_export(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    cfg = toy_config(tmp_path, "steps=3", "save_every=1", "keep_last=2", "lora.enabled=true", "lora.r=4")
    model, _ = run(cfg, tokenizer)
    ckpts = sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"]
    assert latest_checkpoint(tmp_path / "run").name == "step_000003"
    saved = load_file(str(tmp_path / "run/checkpoints/step_000003/policy.safetensors"))
    assert saved and all("lora" in k for k in saved)  # LoRA: only the adapters are trainable state
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run/policy")
    ids = torch.tensor([[10, 50, 51, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, model(ids).logits, atol=1e-5)


def test_run_directory_keeps_trajectories_curves_and_health(tmp_path, tokenizer):
    """Every step's records carry the exact rows with the GRPO advantages, recomputed here from the rewards."""
    from agent_r1.observe.records import read_records, step_files

    _, hist = run(toy_config(tmp_path, "steps=2", "log.tensorboard=true", "algo.zero_variance_groups=keep"), tokenizer)
    root = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "plots/curves.png", "policy/config.json"):
        assert (root / name).is_file(), name
    assert list((root / "tensorboard").glob("events.out.tfevents.*"))
    assert list(step_files(root)) == [1, 2]
    records = list(read_records(step_files(root)[2]))
    assert len(records) == 4 * 4 and all(r["step"] == 2 for r in records)
    by_group: dict[str, list[dict]] = {}
    for r in records:
        by_group.setdefault(r["group_id"], []).append(r)
    for group in by_group.values():
        rewards = torch.tensor([r["reward"] for r in group])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for r, a in zip(group, expected.tolist(), strict=True):
            (row,) = r["rows"]  # the toy env appends to the context: one merged row per episode
            trained = [adv for adv, m in zip(row["advantages"], row["mask"], strict=True) if m]
            assert len(trained) == sum(t["response_tokens"] for t in r["turns"]) > 0
            assert trained == pytest.approx([a] * len(trained), abs=1e-5)
            assert all(adv == 0.0 for adv, m in zip(row["advantages"], row["mask"], strict=True) if not m)
    for h in hist:  # the same weights sampled and scored the tokens: drift is float noise
        assert h["logprob_drift_max"] < 1e-4
        assert {"health/logprob_drift", "health/nonfinite", "health/echo_trap"} <= set(h)
        assert h["health/logprob_drift"] == 0.0 and h["health/nonfinite"] == 0.0


def scripted_validation(monkeypatch, accuracies: list[float], key: str = "accuracy") -> list[int]:
    """Run the real validation rollout, then report the next scripted value of `key`; returns the call log."""
    import agent_r1.trainer.validation as validation
    from agent_r1.evaluate import evaluate as real

    calls: list[int] = []

    def evaluate(engine, make_env, tasks, sampling, *args):
        metrics, trajs = real(engine, make_env, tasks, sampling, *args)
        assert sampling.temperature == 0.0 and len(trajs) == len(tasks) == 3
        calls.append(len(calls))
        return metrics | {key: accuracies[len(calls) - 1]}, trajs

    monkeypatch.setattr(validation, "evaluate", evaluate)
    return calls


def val_config(tmp_path, *overrides: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "val.jsonl"
    tasks = [{"question": "", "answer": 0, "ids": [20 + i, 50, 51]} for i in range(3)]
    data.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return toy_config(tmp_path, "val.every=1", "val.num_tasks=3", f"val.task.data={data}", *overrides)


def test_validation_keeps_the_best_step_as_the_policy(tmp_path, tokenizer, monkeypatch):
    """Step 1 validates best (later ties do not replace it): policy/ holds exactly step 1's weights."""
    from transformers import AutoModelForCausalLM

    from agent_r1.observe.records import read_records, step_files

    calls = scripted_validation(monkeypatch, [0.25, 0.75, 0.5, 0.75])
    model, _ = run(val_config(tmp_path, "steps=3", "save_every=1", "keep_last=3"), tokenizer)
    assert len(calls) == 4  # before training and after each of the 3 steps
    root = tmp_path / "run"
    lines = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["val/accuracy"], m["val/best_step"]) for m in lines] == [
        (0, 0.25, 0),
        (1, 0.75, 1),
        (2, 0.5, 1),
        (3, 0.75, 1),
    ]
    assert json.loads((root / "policy/best.json").read_text()) == {"step": 1, "accuracy": 0.75}
    assert list(step_files(root / "val")) == [0, 1, 2, 3]  # the validation episodes, for the viewer
    assert [r["task"]["ids"][0] for r in read_records(step_files(root / "val")[2])] == [20, 21, 22]
    exported = AutoModelForCausalLM.from_pretrained(root / "policy").state_dict()
    step1 = load_file(str(root / "checkpoints/step_000001/policy.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(exported[name], step1[name]), name
        assert not torch.equal(exported[name], p.detach()) or name.endswith("norm.weight")


def test_validation_selects_on_any_eval_metric(tmp_path, tokenizer, monkeypatch):
    scripted_validation(monkeypatch, [0.1, 0.2, 0.9], key="reward/f1")  # accuracy stays the toy's real one
    _, hist = run(val_config(tmp_path, "steps=2", "val.metric=reward/f1"), tokenizer)
    assert [(h["step"], h["val/best_step"]) for h in hist] == [(0, 0), (1, 1), (2, 2)]
    assert json.loads((tmp_path / "run/policy/best.json").read_text()) == {"step": 2, "reward/f1": 0.9}


def test_a_starting_policy_that_validates_perfectly_is_flagged(tmp_path, tokenizer, monkeypatch, capsys):
    """At accuracy 1 before the first step no RL step can be kept (a tie keeps the earlier step), so the run
    says so at once instead of exporting the starting weights silently at the end."""
    scripted_validation(monkeypatch, [1.0, 1.0])
    _, hist = run(val_config(tmp_path, "steps=1"), tokenizer)
    assert [h["val/best_step"] for h in hist] == [0, 0]
    out = " ".join(capsys.readouterr().out.split())
    assert "the starting policy already scores accuracy 1 on the 3 validation tasks" in out
    assert "val.keep_best=false" in out
    scripted_validation(monkeypatch, [0.75, 1.0])
    run(val_config(tmp_path / "b", "steps=1"), tokenizer)
    assert "starting policy already scores" not in capsys.readouterr().out


def test_an_unknown_validation_metric_is_a_one_line_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"val\.metric='acc' is not an eval metric; choose from .*accuracy"):
        run(val_config(tmp_path, "val.metric=acc"), tokenizer)


def test_validation_of_tasks_passed_in_needs_their_validation_file(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"give val\.task\.data"):
        run(toy_config(tmp_path, "val.every=1"), tokenizer)


def test_resume_keeps_the_best_validation_so_far(tmp_path, tokenizer, monkeypatch):
    scripted_validation(monkeypatch, [0.5, 0.25, 0.25])
    run(val_config(tmp_path, "steps=2", "save_every=2"), tokenizer)
    calls = scripted_validation(monkeypatch, [0.25, 0.25])  # resumed: no new step-0 validation
    _, hist = run(val_config(tmp_path, "steps=4", "save_every=2"), tokenizer)
    assert len(calls) == 2 and [h["val/best_step"] for h in hist] == [0, 0]
    assert json.loads((tmp_path / "run/policy/best.json").read_text())["step"] == 0


class HalfConstantEnv(LowIdEnv):
    """Even tasks always score 0.5 (their groups have no variance); odd tasks are the toy task."""

    async def reset(self, task):
        self.constant = task["ids"][0] % 2 == 0
        return await super().reset(task)

    async def step(self, action):
        result = await super().step(action)
        return result._replace(reward=0.5) if result.done and self.constant else result


def test_reference_scores_only_the_rows_the_update_trains_on(tmp_path, tokenizer):
    from agent_r1.observe.records import read_records, step_files

    cfg = toy_config(tmp_path, "steps=1", "algo.kl_coef=0.1")
    _, hist = run(cfg, tokenizer, env=HalfConstantEnv)
    records = list(read_records(step_files(tmp_path / "run")[1]))
    constant = [r["task"]["ids"][0] % 2 == 0 for r in records]
    assert any(constant) and not all(constant)
    for r, const in zip(records, constant, strict=True):
        assert all((row["ref_logprobs"] is None) == const for row in r["rows"])
    groups = {r["group_id"]: const for r, const in zip(records, constant, strict=True)}
    assert hist[0]["zero_variance_groups"] >= sum(groups.values()) / len(groups) and hist[0]["kl"] >= 0.0


# --- the defects of the first edition, each with the case that broke it ---------------------------------


class SometimesBrokenEnv(LowIdEnv):
    """Tasks whose first id is 10 never start (reset raises); elsewhere a first response that starts with an
    even id makes the env raise in its second step, after one step was recorded."""

    async def reset(self, task):
        if task["ids"][0] == 10:
            raise ConnectionError("the task's data service is down")
        return await super().reset(task)

    async def step(self, action):
        if self.turn == 1 and self.first % 2 == 0:
            raise RuntimeError("tool host crashed")
        if self.turn == 0:
            self.first = action.token_ids[0]
        return await super().step(action)


def test_errored_episodes_are_counted_and_left_out_of_the_update(tmp_path, tokenizer):
    """GRPO advantages are computed over a group's remaining members; an all-errored group is dropped."""
    from agent_r1.observe.records import read_records, step_files

    tasks = [{"ids": [10 + i, 50, 51]} for i in range(4)]  # task 10: every sample errors
    cfg = toy_config(tmp_path, "steps=1", "algo.zero_variance_groups=keep", "health.window=1")
    (h,) = train(cfg, model=tiny_model(), tokenizer=tokenizer, make_env=SometimesBrokenEnv, tasks=tasks)
    records = list(read_records(step_files(tmp_path / "run")[1]))
    errored = [r for r in records if r["termination"] == "error"]
    assert 4 <= len(errored) < len(records) and h["termination/error"] == len(errored) / len(records)
    assert h["trained_episodes"] == len(records) - len(errored) and h["health/errors"] == 1.0
    assert all(all(row["advantages"] is None for row in r["rows"]) for r in errored)
    for group in {r["group_id"] for r in records}:
        ok = [r for r in records if r["group_id"] == group and r["termination"] != "error"]
        if len(ok) < 2:
            continue
        rewards = torch.tensor([r["reward"] for r in ok])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for r, a in zip(ok, expected.tolist(), strict=True):
            trained = [adv for adv, m in zip(r["rows"][0]["advantages"], r["rows"][0]["mask"], strict=True) if m]
            assert trained == pytest.approx([a] * len(trained), abs=1e-5)


class Down(LowIdEnv):
    async def reset(self, task):
        raise ConnectionError("down")


class DownAtFirst(LowIdEnv):
    """The first step's episodes all fail (a sandbox host that is not up yet), then every one works."""

    resets = 0

    async def reset(self, task):
        DownAtFirst.resets += 1
        if DownAtFirst.resets <= 4 * 4:
            raise ConnectionError("down")
        return await super().reset(task)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16 recomputes the old log-probs
def test_groups_whose_every_episode_errors_are_replaced_counted_and_survived(tmp_path, tokenizer, dtype):
    """An errored group is no evidence about the policy: the producer leaves it out and draws another task
    in its place, in lockstep as asynchronously, so the step still trains on tasks_per_step groups."""
    DownAtFirst.resets = 0
    _, hist = run(toy_config(tmp_path, "steps=2", f"dtype={dtype}"), tokenizer, env=DownAtFirst)
    assert [h["rollout/errored_groups"] for h in hist] == [4.0, 0.0]
    assert all(h["termination/error"] == 0 and h["trained_episodes"] == 16 and h["updates"] > 0 for h in hist)


def test_an_environment_that_always_errors_stops_the_run_with_the_last_error(tmp_path, tokenizer):
    """A broken engine or environment gives nothing to learn from: once four steps' worth of groups in a
    row were left out the run stops (RolloutStalled), as it does asynchronously, instead of drawing forever."""
    match = r"the last 16 groups were left out: their episodes all errored \(the last: ConnectionError: down\); stop"
    with pytest.raises(RolloutStalled, match=match):
        run(toy_config(tmp_path, "steps=9", "save_every=1"), tokenizer, env=Down)
    assert latest_checkpoint(tmp_path / "run") is None


class OverflowEnv(LowIdEnv):
    """Tasks whose first id is 10 start with a prompt longer than the context: no step is ever taken."""

    async def reset(self, task):
        obs = await super().reset(task)
        return Observation(token_ids=obs.token_ids * 400) if task["ids"][0] == 10 else obs


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline", "grpo", "gigpo", "turn_grpo", "ppo"])
def test_episodes_without_steps_do_not_break_any_estimator(tmp_path, tokenizer, estimator):
    tasks = [{"ids": [10 + i, 50, 51]} for i in range(4)]
    cfg = toy_config(tmp_path, "steps=1", f"algo.estimator={estimator}", "algo.zero_variance_groups=keep")
    (h,) = train(cfg, model=tiny_model(), tokenizer=tokenizer, make_env=OverflowEnv, tasks=tasks)
    assert h["termination/context_overflow"] == 0.25 and h["trained_episodes"] == 12 and h["updates"] == 1


def test_zero_variance_is_judged_on_the_task_reward_not_on_kl_shaped_returns(tmp_path, tokenizer):
    """With the KL in the reward, the constant-reward groups still count as zero-variance once the policy
    has moved away from the reference (KL noise would otherwise make them look informative)."""
    from agent_r1.observe.records import read_records, step_files

    cfg = toy_config(tmp_path, "steps=3", "algo.kl_coef=0.5", "algo.kl_mode=reward", "optim.lr=5e-2")
    _, hist = run(cfg, tokenizer, env=HalfConstantEnv)
    for h in hist[1:]:  # after the first update the policy differs from the reference
        records = list(read_records(step_files(tmp_path / "run")[h["step"]]))
        groups = {r["group_id"]: r["task"]["ids"][0] % 2 == 0 for r in records}
        assert h["kl_in_reward"] != 0.0
        assert h["zero_variance_groups"] == sum(groups.values()) / len(groups)


def test_training_refuses_greedy_sampling_and_gspo_gets_its_own_clip_range(tmp_path):
    with pytest.raises(ValueError, match=r"rollout\.temperature must be > 0 for training"):
        toy_config(tmp_path, "rollout.temperature=0")
    assert toy_config(tmp_path).algo.clip_range() == (0.2, 0.28)
    assert toy_config(tmp_path, "algo.policy_loss=gspo").algo.clip_range() == (3e-4, 4e-4)
    assert toy_config(tmp_path, "algo.policy_loss=gspo", "algo.clip_high=1e-3").algo.clip_range() == (3e-4, 1e-3)
    assert toy_config(tmp_path).algo.clip_low is None  # unset stays unset: a saved config can switch loss


def test_a_kill_between_checkpoints_resumes_without_duplicates_and_keeps_best_and_policy_in_step(
    tmp_path, tokenizer, monkeypatch
):
    """Checkpoints at steps 2 and 4; the run dies right after step 3 was logged and validated (a new best
    exported to policy/). The resumed run redoes step 3 from the step-2 checkpoint."""
    scripted_validation(monkeypatch, [0.1] * 5)
    straight, _ = run(val_config(tmp_path / "a", "steps=4", "save_every=2"), tokenizer)

    scripted_validation(monkeypatch, [0.1, 0.2, 0.3, 0.9])
    with killed_after_logging(monkeypatch, 3):
        run(val_config(tmp_path / "b", "steps=4", "save_every=2"), tokenizer)
    scripted_validation(monkeypatch, [0.25, 0.5])  # the redone step 3 validates worse this time
    resumed, hist = run(val_config(tmp_path / "b", "steps=4", "save_every=2"), tokenizer)

    root = tmp_path / "b/run"
    lines = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]  # step 3 once, although it ran twice
    best = json.loads((root / "policy/best.json").read_text())
    assert best == {"step": 3, "accuracy": 0.9} and [h["val/best_step"] for h in hist] == [3, 3]
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    a = [json.loads(x)["reward_mean"] for x in (tmp_path / "a/run/metrics.jsonl").read_text().splitlines()[1:]]
    assert a == [m["reward_mean"] for m in lines[1:]]


def test_a_resumed_run_judges_health_trends_from_the_runs_first_steps(tmp_path, tokenizer):
    """A trend check compares with the run's first steps; after a resume it must still see them, or
    its flags in metrics.jsonl differ from an uninterrupted run's. Set to fire on any trend (window 1:
    from step 2 on)."""
    health = ("health.window=1", "health.format_error_rise=-1")
    run(toy_config(tmp_path / "a", "steps=4", *health), tokenizer)
    run(toy_config(tmp_path / "b", "steps=2", *health), tokenizer)
    run(toy_config(tmp_path / "b", "steps=4", *health), tokenizer)  # resumes from step 2

    def flags(d):
        return [json.loads(x)["health/format_collapse"] for x in (d / "run/metrics.jsonl").read_text().splitlines()]

    assert flags(tmp_path / "a") == [0.0, 1.0, 1.0, 1.0]
    assert flags(tmp_path / "b") == flags(tmp_path / "a")


def test_resume_refuses_a_changed_config_naming_the_key(tmp_path, tokenizer):
    run(toy_config(tmp_path, "steps=1"), tokenizer)
    with pytest.raises(ValueError, match=r"config differs at 'optim\.lr' \(0\.01 there, 0\.02 now\)"):
        run(toy_config(tmp_path, "steps=2", "optim.lr=2e-2"), tokenizer)
    before = (tmp_path / "run/config.yaml").read_text()
    assert "lr: 0.01" in before  # the refused run did not overwrite the run's config
    _, hist = run(toy_config(tmp_path, "steps=2", "save_every=5"), tokenizer)  # more steps: a resume
    assert [h["step"] for h in hist] == [2]


def test_the_policy_written_by_training_records_how_to_prompt_it(tmp_path, tokenizer):
    run(toy_config(tmp_path, "steps=1"), tokenizer)
    info = json.loads((tmp_path / "run/policy/agent_r1.json").read_text())
    assert info["prompt_format"] == "chat" and info["tool_call_format"]["name"] == "hermes"
    assert info["task"] is None  # an env passed in is not the config's task: nothing to claim


def test_training_through_a_remote_engine_syncs_the_weights_every_step(tmp_path, tokenizer):
    """rollout.engine=remote: `agent-r1 serve` starts with other weights. The trainer syncs its policy before
    the first rollout and after every update, so the served log-probs are the trainer's own (no drift)."""
    import httpx

    from agent_r1.engines.cpu.local_engine import LocalEngine
    from agent_r1.env.prompt_format import ChatFormat
    from agent_r1.serve import ServedModel, create_app
    from tests.conftest import serving

    served = LocalEngine(tiny_model(seed=3), tokenizer, max_context=1024)
    with serving(
        create_app(
            ServedModel(served, tokenizer, ChatFormat(tokenizer), "toy", served.eos_ids, allow_weight_updates=True)
        )
    ) as url:
        cfg = toy_config(tmp_path, "steps=2", "rollout.engine=remote", f"rollout.url={url}")
        _, hist = run(cfg, tokenizer)
        version = httpx.get(f"{url}/v1/models").json()["data"][0]["weights_version"]
    assert all(h["updates"] == 1 and h["logprob_drift_max"] < 1e-4 for h in hist)
    assert version == 2 and hist[-1]["time/weight_sync"] > 0  # the policy version: RL steps done


def test_asynchronous_training_through_a_remote_engine_loads_weights_between_tokens(tmp_path, tokenizer):
    """rollout.engine=remote with rollout.max_staleness=1: the producer rolls out through `agent-r1 serve`,
    which takes each update's weights between two tokens and says which version sampled each token."""
    import httpx

    from agent_r1.engines.cpu.local_engine import LocalEngine
    from agent_r1.env.prompt_format import ChatFormat
    from agent_r1.serve import ServedModel, create_app
    from tests.conftest import serving

    served = LocalEngine(tiny_model(seed=3), tokenizer, max_context=1024)
    with serving(
        create_app(
            ServedModel(served, tokenizer, ChatFormat(tokenizer), "toy", served.eos_ids, allow_weight_updates=True)
        )
    ) as url:
        cfg = toy_config(tmp_path, "steps=3", "rollout.engine=remote", f"rollout.url={url}", "rollout.max_staleness=1")
        _, hist = run(cfg, tokenizer)
        version = httpx.get(f"{url}/v1/models").json()["data"][0]["weights_version"]
    assert version == 3  # the trainer's weights as version 0 before it started, then one per step
    assert all(h["updates"] == 1 and h["async/version_lag_max"] <= 1 and h["trained_episodes"] == 16 for h in hist)
    # the served log-probs are the trainer's own wherever the current weights sampled a whole step
    assert all(h["logprob_drift_max"] < 1e-4 for h in hist), [h["logprob_drift_max"] for h in hist]


def test_the_prompt_format_follows_the_model_passed_in_not_the_configs_model(tmp_path, tokenizer):
    """cfg.model names a chat model (the default), but the model passed in has a tokenizer without a chat
    template: `prompt_format=auto` must pick plain text for it (and never build the config's task env)."""
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    cfg = toy_config(tmp_path, "steps=1", "prompt_format=auto", "task=hotpotqa")
    train(cfg, model=tiny_model(), tokenizer=plain, make_env=LowIdEnv, tasks=TASKS)
    assert json.loads((tmp_path / "run/policy/agent_r1.json").read_text())["prompt_format"] == "text"


def test_each_trajectory_is_merged_once_per_step(tmp_path, tokenizer, monkeypatch):
    """The rows the update trains on and the rows the trajectory records show come from one merge."""
    import agent_r1.observe.records as records
    import agent_r1.trainer.rl as rl

    calls = {"trainer": 0, "records": 0}

    def counting(where, real):
        return lambda t: calls.__setitem__(where, calls[where] + 1) or real(t)

    monkeypatch.setattr(rl, "merge_trajectory", counting("trainer", rl.merge_trajectory))
    monkeypatch.setattr(records, "merge_trajectory", counting("records", records.merge_trajectory))
    run(toy_config(tmp_path, "steps=2", "log.trajectories_every=1"), tokenizer)
    assert calls == {"trainer": 2 * 4 * 4, "records": 0}


def test_dr_grpo_normalises_by_one_steps_token_budget(tmp_path, tokenizer, monkeypatch):
    """A "sequence" of the seq-mean aggregations is one step's response, so Dr.GRPO's constant is one
    step's budget, rollout.max_new_tokens (6), not the episode's (6 x 3 turns)."""
    import agent_r1.trainer.update as update

    seen = []
    real = update.ppo_policy_loss
    monkeypatch.setattr(update, "ppo_policy_loss", lambda *a, **k: seen.append(k["norm_len"]) or real(*a, **k))
    cfg = toy_config(tmp_path, "steps=1", "algo.estimator=drgrpo", "algo.loss_agg=seq-mean-token-sum-norm",
                     "rollout.max_turns=3", "algo.zero_variance_groups=keep")  # fmt: skip
    run(cfg, tokenizer)
    assert seen and set(seen) == {6.0}


def test_the_saved_config_loads_back_and_can_switch_task(tmp_path, tokenizer):
    from agent_r1.config import load_config
    from agent_r1.trainer.config import TrainConfig

    cfg = toy_config(tmp_path, "steps=1", "task.ops=[2,3]", "val.task.ops=[1]", "algo.policy_loss=gspo")
    run(cfg, tokenizer)
    saved = tmp_path / "run/config.yaml"
    assert load_config(TrainConfig, str(saved)) == cfg
    other = load_config(TrainConfig, str(saved), ["task=gsm8k", "val.task={}"])  # the file's ops were calculator's
    assert other.task.name == "gsm8k" and other.algo.clip_range() == (3e-4, 4e-4)


def test_validation_never_runs_silently_on_the_training_file(tmp_path):
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"question": "q", "answer": 1}\n')
    with pytest.raises(ValueError, match=r"give val\.task\.data"):
        toy_config(tmp_path, f"task.data={data}", "val.every=2")
    assert toy_config(tmp_path, f"task.data={data}", "val.every=2", f"val.task.data={data}").val.every == 2


def test_an_rl_step_on_pictures_trains_through_the_vision_tower(tmp_path, tiny_llava):
    """The digits task end to end in the trainer: rollouts with pictures, merged rows, the update; the
    old log-probs the trainer recomputes match the rollout's, and the tower's weights move (the tiny
    random model earns no reward, so an entropy bonus is what has a gradient)."""
    import copy

    from agent_r1.config import load_config
    from agent_r1.trainer.config import TrainConfig

    model, processor = tiny_llava
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "vision_tower" in n}
    cfg = load_config(
        TrainConfig,
        None,
        [f"run_dir={tmp_path}", "task=digits", "steps=1", "optim.lr=1e-3", "rollout.tasks_per_step=2",
         "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_turns=2", "prompt_format=chat",
         "algo.old_logprobs=recompute", "algo.zero_variance_groups=keep", "algo.entropy_coef=0.1", "device=cpu"],
    )  # fmt: skip
    (h,) = train(cfg, model=model, tokenizer=processor)
    assert h["logprob_drift_max"] <= 1e-4
    assert max((p - before[n]).abs().max().item() for n, p in model.named_parameters() if "vision_tower" in n) > 0


def test_dynamic_sampling_trains_on_groups_that_differ_in_lockstep_and_asynchronously(tmp_path, tokenizer):
    """DAPO's dynamic sampling, a filter on the producer's stream (tests/rollout/test_producer.py): every
    step counts the groups it looked at and kept, at any max_staleness; a group's return is the one the
    estimators see."""
    from agent_r1.trainer.config import AlgoConfig
    from agent_r1.trainer.setup import task_return
    from agent_r1.types import Step, Trajectory

    noted = [Trajectory(task={}, traj_id=f"p-{i}", group_id="p",
                        steps=[Step([1], [2], [0.0], r), Step([1], [2], [0.0], 0.0, done=True)])
             for i, r in enumerate([0.5, 0.0])]  # fmt: skip
    # what train judges by: the weighted process rewards, none when they are a potential's (they telescope)
    assert task_return(AlgoConfig(process_reward_weight=0.5), noted[0]) == 0.25
    assert task_return(AlgoConfig(process_reward_weight=0.5, process_reward_potential=True), noted[0]) == 0.0

    for k in (0, 1):
        cfg = toy_config(tmp_path / str(k), "steps=2", "rollout.dynamic_sampling=true", "rollout.max_draws=3",
                         f"rollout.max_staleness={k}")  # fmt: skip
        _, hist = run(cfg, tokenizer)
        assert all(4 <= h["dynamic_sampling/groups_drawn"] <= 12 for h in hist), k
        assert all(h["dynamic_sampling/groups_kept"] <= 4 and h["trained_episodes"] == 16 for h in hist), k
