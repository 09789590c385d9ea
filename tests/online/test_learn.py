"""`agent-r1 learn`'s producer over the store (groups, implicit rewards, the per-user cap, bounded staleness,
claims, the gate) and the whole loop: live HTTP traffic -> store -> one RL step -> a new version served."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import httpx
import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from agent_r1.config import load_config
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.online.learn import LearnConfig, RollbackConfig, StoreSource, run_learn, run_rollback
from agent_r1.online.record import Recorder
from agent_r1.online.rewards import JudgeConfig
from agent_r1.online.store import Interaction, Store
from agent_r1.serve import ServedModel, create_app
from agent_r1.trainer.config import TrainConfig
from tests.conftest import make_tiny_llama, serving

QUIET = Console(quiet=True)


def learn_config(tmp_path, *overrides: str, **kw) -> LearnConfig:
    train = load_config(
        TrainConfig, None,
        [f"run_dir={tmp_path / 'trainer'}", "rollout.tasks_per_step=1", "rollout.group_size=4",
         "rollout.max_new_tokens=8", "optim.lr=1e-3", *overrides],
    )  # fmt: skip
    base = dict(
        store=str(tmp_path / "store.db"), servers=["http://127.0.0.1:9"], versions_dir=str(tmp_path / "versions"),
        train=train, session_idle_s=0.0, group_wait_s=0.0, poll_s=0.01, user_cap=1.0, max_staleness=1,
    )  # fmt: skip
    return LearnConfig(**(base | kw))


def turn(session: str, turn: int, text: str, *, user: str = "", prompt=(1, 2, 3), version: int = 0, asks=True):
    return Interaction(
        id=f"{session}-{turn}", session=session, user=user or session, request=f"{session}-{turn}", served=True,
        turn=turn, prompt_ids=[*prompt, *range(10, 10 + 3 * turn)], response_ids=[5, 6], logprobs=[-1.0, -2.0],
        versions=[version, version], user_text=text, answer=f"answer {turn}", asks=asks, created=time.time() - 5,
    )  # fmt: skip


def source(cfg: LearnConfig, store: Store, policy=None, scores=(0.5,), start: int = 0) -> StoreSource:
    it = iter(scores)
    last = [scores[0]]

    def gate(model):
        last[0] = next(it, last[0])
        return last[0]

    policy = policy or make_tiny_llama(300, seed=0)
    return StoreSource(cfg, store, gate, policy, start, QUIET)


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "store.db"))
    yield s
    s.close()


def test_sessions_become_trajectories_grouped_by_their_opening_with_implicit_rewards(tmp_path, store):
    reactions = {"s1": "Thanks!", "s2": "great, thank you", "s3": "No, that's wrong", "s4": "Q"}  # s4 re-asks
    for s, reaction in reactions.items():
        store.record([turn(s, 0, "Q"), turn(s, 1, reaction)])
    store.record([turn("other", 0, "Q", prompt=(9, 9))])  # another opening: a group of one, not ready
    src = source(learn_config(tmp_path), store)
    trajs, metrics = src.take()
    assert sorted(t.traj_id for t in trajs) == ["s1", "s2", "s3", "s4"]
    assert len({t.group_id for t in trajs}) == 1
    outcomes = {t.traj_id: t.outcome for t in trajs}
    assert outcomes == {"s1": 1.0, "s2": 1.0, "s3": 0.0, "s4": 0.0}  # the reaction to the first answer
    # the answers nobody reacted to (the last of each session) are not trained: the reward is the first answer's
    assert all(len(t.steps) == 1 and t.steps[0].done for t in trajs)
    assert store.counts()["skipped"] == 4
    stored = store.rewards(["s1-0", "s3-0", "s1-1"], [])
    assert [(r["interaction"], r["source"], r["score"]) for r in stored] == [
        ("s1-0", "implicit", 1.0),
        ("s3-0", "implicit", 0.0),
    ]  # the last answers have nothing after them
    assert {i.id for i in store.untrained()} == {"other-0"}  # the step's interactions are claimed
    assert metrics["online/users"] == 4


def test_a_tool_result_is_not_a_users_reaction_and_explicit_feedback_wins(tmp_path, store):
    store.record([turn("a", 0, "Q"), turn("a", 1, "Q", asks=False), turn("a", 2, "thanks")])
    store.record([turn("b", 0, "Q"), turn("b", 1, "Q", asks=False), turn("b", 2, "thanks")])
    store.add_reward("explicit", 0.2, session="b")
    trajs, _ = source(learn_config(tmp_path), store).take()
    got = {t.traj_id: (t.outcome, t.process_rewards) for t in trajs}
    # a: the first answer was a call answered by a tool (no signal); the second was thanked
    assert got == {"a": (1.0, [0.0, 0.0]), "b": (0.2, [0.0, 1.0, 0.0])}  # a's thanked answer ends it


def explored(store: Store, texts: list[str]) -> None:
    """One request explored: its answers share the prompt; the first was served."""
    store.record([
        dataclasses.replace(turn("x", 0, "Q"), id=f"x-{k}", served=k == 0, request="x", answer=text)
        for k, text in enumerate(texts)
    ])  # fmt: skip


def good_judge(user_text: str, answer: str) -> float:
    return 1.0 if "good" in answer else 0.0


def broken_judge(user_text: str, answer: str) -> float:
    raise ConnectionError("judge unreachable")


def test_exploration_groups_are_scored_by_the_judge(tmp_path, store):
    explored(store, ["a good answer", "a bad one", "good again"])
    cfg = learn_config(tmp_path, judge=JudgeConfig(function="tests.online.test_learn:good_judge"))
    trajs, _ = source(cfg, store).take()
    assert sorted((t.steps[0].text, t.outcome) for t in trajs) == [
        ("a bad one", 0.0), ("a good answer", 1.0), ("good again", 1.0)
    ]  # fmt: skip
    assert len({t.group_id for t in trajs}) == 1
    assert {r["source"] for r in store.rewards(["x-0", "x-1", "x-2"], [])} == {"judge"}


def test_a_judge_that_fails_leaves_answers_waiting_and_is_not_asked_every_poll(tmp_path, store):
    explored(store, ["one", "two"])
    src = source(learn_config(tmp_path, judge=JudgeConfig(function="tests.online.test_learn:broken_judge")), store)
    for _ in range(3):
        groups, metrics = src._groups()
        assert groups == [] and metrics["online/unscored"] == 2
    assert store.counts()["judge_failures"] == 2  # once per answer, not once per poll
    assert len(store.untrained()) == 2  # nothing dropped: they wait for the judge


def test_no_user_gets_more_than_the_cap_of_a_batch(tmp_path, store):
    for k in range(6):
        store.record([turn(f"adv{k}", 0, "Q", user="adversary"), turn(f"adv{k}", 1, "thanks", user="adversary")])
    for k in range(3):
        store.record([turn(f"h{k}", 0, "Q", user=f"honest{k}"), turn(f"h{k}", 1, "no", user=f"honest{k}")])
    cfg = learn_config(tmp_path, "rollout.group_size=8", user_cap=0.25)  # 2 of a batch of 8
    trajs, metrics = source(cfg, store).take()
    users = [t.task["user"] for t in trajs]
    assert users.count("adversary") == 2 and len(trajs) == 5
    assert metrics["online/top_user_share"] == 2 / 5
    assert sum(i.user == "adversary" for i in store.untrained()) == 4  # the rest wait for later batches


def test_answers_older_than_the_staleness_bound_are_skipped(tmp_path, store):
    for k in range(2):
        store.record([turn(f"old{k}", 0, "Q", version=0), turn(f"old{k}", 1, "thanks", version=0)])
    src = source(learn_config(tmp_path), store, scores=(0.5, 0.6, 0.7))  # max_staleness=1
    for step in (1, 2):  # two steps trained (on nothing here) and promoted: the answers are 2 steps old
        src.step = step
        src.publish(src.policy)
    for k in range(2):
        store.record([turn(f"new{k}", 0, "Q", version=2), turn(f"new{k}", 1, "no", version=2)])
    trajs, metrics = src.take()
    assert sorted(t.traj_id for t in trajs) == ["new0", "new1"] and metrics["online/stale_skipped"] == 4
    assert store.counts()["skipped"] == 6  # the 4 stale answers, and the 2 new ones nobody reacted to


def test_a_resumed_trainer_releases_the_claims_its_checkpoint_does_not_hold(tmp_path, store):
    for s in ("a", "b"):
        store.record([turn(s, 0, "Q"), turn(s, 1, "thanks" if s == "a" else "no")])
    source(learn_config(tmp_path), store).take()  # claimed by step 1, whose update is then lost
    assert store.untrained() == []
    again = source(learn_config(tmp_path), store, start=0)
    assert again.released == 2 and len(store.untrained()) == 2


def test_the_gate_promotes_or_rejects_and_a_rejected_trainer_returns_to_the_serving_weights(tmp_path, store):
    policy = make_tiny_llama(300, seed=0)
    src = source(learn_config(tmp_path), store, policy, scores=(0.5, 0.6, 0.55))
    assert [(v.version, v.status, v.score) for v in store.versions()] == [(0, "serving", 0.5)]
    with torch.no_grad():
        policy.model.norm.weight.add_(1.0)
    promoted = src.publish(policy)
    assert promoted["gate/promoted"] == 1.0 and store.serving().version == 1
    serving_path = store.serving().path
    assert torch.equal(load_file(serving_path)["model.norm.weight"], policy.model.norm.weight)
    with torch.no_grad():
        policy.model.norm.weight.add_(5.0)
    rejected = src.publish(policy)  # 0.55 < 0.6: not promoted
    assert rejected["gate/promoted"] == 0.0 and store.serving().version == 1
    assert store.versions()[-1].status == "rejected" and store.versions()[-1].path is None
    assert torch.equal(policy.model.norm.weight, load_file(serving_path)["model.norm.weight"])  # went back


def test_only_keep_versions_weights_files_are_kept(tmp_path, store):
    src = source(learn_config(tmp_path, keep_versions=2), store, scores=(0.5, 0.6, 0.7, 0.8, 0.9))
    for step in range(1, 5):
        src.step = step
        src.publish(src.policy)
    kept = {v.version: v.path for v in store.versions() if v.path}
    assert sorted(kept) == [0, 2, 3, 4]  # the start, 2 newest others, the serving one
    files = sorted(p.name for p in (tmp_path / "versions").iterdir())
    assert len(files) == 4 and all(Path(p).is_file() for p in kept.values())
    with pytest.raises(ValueError, match="version 1 is not kept"):
        run_rollback(RollbackConfig(store=store.where, version=1, servers=[]))


def test_rollback_serves_a_kept_version_again(tmp_path, store):
    src = source(learn_config(tmp_path), store, scores=(0.5, 0.7))
    src.publish(src.policy)
    number = run_rollback(RollbackConfig(store=store.where, version=0, servers=["http://127.0.0.1:9"]))
    assert number == 2 and store.serving().path == store.versions()[0].path
    with pytest.raises(ValueError, match=r"version 7 is not kept .* kept: 0, 1, 2"):
        run_rollback(RollbackConfig(store=store.where, version=7, servers=[]))
    with torch.no_grad():
        src.policy.model.norm.weight.add_(1.0)
    followed = src.publish(src.policy)  # the running trainer sees the rollback: it goes on from version 0
    assert followed == {"gate/promoted": 0.0, "online/followed_rollback": 1.0}
    start = load_file(store.versions()[0].path)["model.norm.weight"]
    assert torch.equal(src.policy.model.norm.weight, start) and store.serving().version == 2


def test_a_trainer_resumed_behind_the_serving_version_serves_its_checkpoint(tmp_path, store):
    """Killed after promoting step 1, before its checkpoint: step 1's claims are released, so step 1's weights
    must not serve (nor train on), or its interactions would count twice."""
    src = source(learn_config(tmp_path), store, scores=(0.5, 0.7))
    src.step = 1
    src.publish(src.policy)
    assert store.serving().step == 1
    source(learn_config(tmp_path), store, scores=(0.5,), start=0)
    assert (store.serving().step, store.serving().version) == (0, 2) and "resumed" in store.serving().note


def test_learn_config_is_checked(tmp_path):
    with pytest.raises(ValueError, match="user_cap"):
        learn_config(tmp_path, user_cap=0.0)
    with pytest.raises(ValueError, match="min_group"):
        learn_config(tmp_path, min_group=1)
    with pytest.raises(ValueError, match=r"val\.every must be 0"):
        learn_config(tmp_path, "val.every=2")
    with pytest.raises(ValueError, match="max_staleness must be >= 1"):
        learn_config(tmp_path, max_staleness=0)
    with pytest.raises(ValueError, match=r"not train\.rollout\.max_staleness"):
        learn_config(tmp_path, "rollout.max_staleness=3")


def test_live_traffic_trains_a_step_and_the_server_takes_the_new_version(tmp_path, tool_model_dir, tokenizer):
    """serve --learn in a real HTTP server; users ask, react and score; one agent-r1 learn step; the gate
    promotes the update and the server samples from exactly the trainer's new weights."""
    store = Store(str(tmp_path / "store.db"))
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    engine = LocalEngine(model, tokenizer, max_context=512, seed=0)
    served = ServedModel(
        engine, tokenizer, ChatFormat(tokenizer), "m", engine.eos_ids, allow_weight_updates=True,
        recorder=Recorder(store),
    )  # fmt: skip
    with serving(create_app(served)) as url:
        for k in range(4):
            ask = [{"role": "user", "content": "What is 6 * 7?"}]
            body = {"model": "m", "messages": ask, "max_tokens": 8, "temperature": 1.0, "seed": k}
            first = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
            said = first["choices"][0]["message"]["content"] or ""
            follow = [*ask, {"role": "assistant", "content": said}, {"role": "user", "content": "thanks"}]
            httpx.post(f"{url}/v1/chat/completions", json=body | {"messages": follow}, timeout=60)
            score = {"response_id": first["id"], "score": k / 3}
            assert httpx.post(f"{url}/v1/feedback", json=score, timeout=10).status_code == 200
        cfg = learn_config(
            tmp_path, f"model={tool_model_dir}", "steps=1", "save_every=1", "prompt_format=chat",
            servers=[url], gate_tasks=2,
        )  # fmt: skip
        history = run_learn(cfg, QUIET)
        assert engine.weights_version == 1  # the starting weights were 0, pushed too
    assert history[-1]["gate/promoted"] == 1.0 and history[-1]["trained_episodes"] == 4
    # the consistency check on live traffic: the server's log-probs are the trainer's, recomputed
    assert 0 < history[-1]["logprob_drift_max"] < 1e-3, history[-1]["logprob_drift_max"]
    assert store.counts()["trained"] == 4  # the 4 scored answers, claimed by step 1 (the replies to thanks are not)
    trained = load_file(store.serving().path)
    now = engine.model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in trained.items())
    start = AutoModelForCausalLM.from_pretrained(tool_model_dir).state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in trained.items())  # the update changed the weights
    store.close()
