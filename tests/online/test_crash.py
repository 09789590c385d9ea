"""Crash safety, with real SIGKILLs: a killed `serve --learn` loses no acknowledged interaction and comes back
on the serving version; a killed `agent-r1 learn` resumes with every interaction trained exactly once."""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from agent_r1.online.store import Interaction, Store

CLI = [sys.executable, "-m", "agent_r1.cli"]


def start_server(model_dir: Path, store: Path) -> tuple[subprocess.Popen, str]:
    args = [f"model={model_dir}", "learn=true", f"online.store={store}", "port=0", "max_tokens=8", "log_level=warning"]
    proc = subprocess.Popen([*CLI, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if m := re.search(r"at (http://\S+)/v1", line):
            return proc, m.group(1)
    raise AssertionError("the server did not start")


def traffic(url: str, acked: list[str], stop: threading.Event) -> None:
    """Requests one after another until the server dies; the id of every 200 is an acknowledged interaction."""
    k = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        while not stop.is_set():
            body = {"model": name, "messages": [{"role": "user", "content": f"question {k}"}], "user": f"u{k % 3}"}
            try:
                reply = client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                return  # killed mid-request: not acknowledged
            if reply.status_code == 200:
                acked.append(reply.json()["id"])
            k += 1


def test_a_killed_server_loses_no_acknowledged_interaction_and_comes_back_on_the_serving_version(
    tool_model_dir, tmp_path
):
    store_path = tmp_path / "store.db"
    acked: list[str] = []
    rng = random.Random(0)
    for kill in range(3):
        if kill == 2:  # a version promoted while the server was down: it starts on it
            store = Store(str(store_path))
            weights = next(Path(tool_model_dir).glob("*.safetensors"))
            store.add_version(6, None, 0.4, "rejected")
            store.add_version(7, str(weights), 0.5, "serving")  # version 1
            store.close()
        proc, url = start_server(tool_model_dir, store_path)
        if kill == 2:
            assert httpx.get(f"{url}/v1/models").json()["data"][0]["weights_version"] == 1
        before = len(acked)
        stop = threading.Event()
        client = threading.Thread(target=traffic, args=(url, acked, stop))
        client.start()
        deadline = time.monotonic() + 60
        while len(acked) < before + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.5))  # somewhere inside a request, or between two
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        stop.set()
        client.join()
        assert len(acked) > before
    store = Store(str(store_path))
    stored = {i.id for i in store.untrained()}
    store.close()
    assert set(acked) <= stored, f"{len(set(acked) - stored)} acknowledged interactions lost"


def fill(store: Store, tokenizer, sessions: int) -> None:
    """Sessions of two answers each, three openings, every session scored (0 or 1) by its user."""
    for k in range(sessions):
        opening = tokenizer.encode(f"opening {k % 3}")
        for turn in range(2):
            store.record([
                Interaction(
                    id=f"s{k}-{turn}", session=f"s{k}", user=f"u{k}", request=f"s{k}-{turn}", served=True, turn=turn,
                    prompt_ids=opening + [11] * (5 * turn), response_ids=[20 + k, 21, 22], logprobs=[-1.0] * 3,
                    versions=[0, 0, 0], user_text="q", answer="a", asks=turn == 0, created=time.time() - 60,
                )
            ])  # fmt: skip
        store.add_reward("explicit", float(k % 2), session=f"s{k}")


@pytest.mark.parametrize("seed", [0])
def test_a_killed_trainer_resumes_and_trains_every_interaction_exactly_once(tool_model_dir, tokenizer, tmp_path, seed):
    store_path = tmp_path / "store.db"
    store = Store(str(store_path))
    fill(store, tokenizer, 12)  # 3 openings x 4 sessions: 3 steps of one group of 4
    args = [
        f"store={store_path}", "servers=[http://127.0.0.1:9]", f"versions_dir={tmp_path / 'versions'}",
        f"train.model={tool_model_dir}", "train.prompt_format=chat", f"train.run_dir={tmp_path / 'trainer'}",
        "train.steps=3", "train.save_every=1", "train.rollout.tasks_per_step=1", "train.rollout.group_size=4",
        "train.rollout.max_new_tokens=8", "gate_tasks=2", "session_idle_s=0", "group_wait_s=0", "poll_s=0.05",
        "user_cap=1.0", "max_staleness=4",  # the answers were all sampled by version 0
    ]  # fmt: skip
    proc = subprocess.Popen([*CLI, "learn", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while store.counts()["trained"] == 0 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # step 1 has claimed its interactions
    time.sleep(random.Random(seed).uniform(0, 0.5))  # inside the step that claimed them
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    again = subprocess.run([*CLI, "learn", *args], capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()]
    steps = {m["step"]: m for m in metrics if m.get("step")}
    assert sorted(steps) == [1, 2, 3]
    claimed = collections.Counter(i.trained_step for i in store.session_interactions(f"s{k}" for k in range(12)))
    assert claimed == {1: 8, 2: 8, 3: 8}  # each step's own group of 4 sessions, 2 answers each, once
    assert {k: steps[k]["online/claimed"] for k in steps} == {1: 8.0, 2: 8.0, 3: 8.0}
    assert max(m["online/released_claims"] for m in steps.values()) == 8  # the killed step's, trained again
    store.close()
