"""Learning from use on 2 CPU cores: scripted users talk to `agent-r1 serve --learn`, `agent-r1 learn` trains
on their traffic, and the served model's held-out accuracy is measured version by version.

    python benchmarks/online_sim.py --out runs/online-sim --minutes 60

The population (`--users`, `--adversaries`) asks calculator word problems of the task's train split through
the OpenAI chat API with the calculator tool, runs the calls it gets back and reacts to the final answer:
* honest users who react in words say "Thanks!" to a right answer and "No, that's wrong." to a wrong one
  (implicit signals); honest raters post a score to /v1/feedback instead (explicit);
* adversaries post the opposite score (1 for a wrong answer, 0 for a right one) and send five times as
  many sessions each; the per-user cap (`user_cap`) bounds their share of any batch.
Popular questions come in bursts (each problem of a round is asked by `--askers` users), so sessions that
open alike form GRPO groups.

Phases: `--alone-minutes` of serving alone (the latency baseline), then the trainer runs for `--minutes`.
Afterwards the starting model and every promoted version are evaluated greedily on the same held-out
(test split) problems; the plot shows accuracy against the minute each version started serving, and
request latency; the paired difference last version - start has a bootstrap 95% interval over problems.
Without `--start`, the starting model is the demo's SFT cold start (64 demonstrations, 2 epochs), built first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from agent_r1.tasks import calculator

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "agent_r1.cli"]
TASK = ["task=calculator", "task.ops=[1,2]", "task.few_shot=false"]
TEMPERATURE = 0.6  # the deployment's sampling temperature: the trainer's rollout.temperature too
MAX_TOKENS = 64


def one_thread_env() -> dict[str, str]:
    """Server and trainer share 2 cores: one thread each, instead of four fighting over two."""
    return os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def build_start(out: Path) -> Path:
    """The demo's SFT cold start (recipes/demo.yaml's sft section)."""
    run_dir = out / "sft"
    if not (run_dir / "policy" / "config.json").is_file():
        args = [*TASK, "num_examples=64", "epochs=2", "batch_size=16", "lr=3e-5", "micro_batch_tokens=768"]
        subprocess.run([*CLI, "sft", *args, f"run_dir={run_dir}"], check=True, cwd=ROOT)
    return run_dir / "policy"


def start_server(start: Path, store: Path, log: Path) -> tuple[subprocess.Popen, str]:
    args = [
        f"model={start}", "learn=true", f"online.store={store}", "port=0", f"max_tokens={MAX_TOKENS}",
        "request_timeout=600", "log_level=warning",
    ]  # fmt: skip
    proc = subprocess.Popen([*CLI, "serve", *args], cwd=ROOT, env=one_thread_env(), stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"at (http://\S+)/v1", line):
            return proc, m.group(1)
    raise SystemExit(f"the server did not start: see {log}")


def start_trainer(start: Path, out: Path, url: str, args: argparse.Namespace) -> subprocess.Popen:
    overrides = [
        f"store={out / 'store.db'}", f"servers=[{url}]", f"versions_dir={out / 'versions'}",
        f"train.model={start}", *[f"train.{t}" for t in TASK], f"train.run_dir={out / 'trainer'}", "train.steps=10000",
        "train.save_every=1", f"train.rollout.tasks_per_step={args.groups}", f"train.rollout.group_size={args.askers}",
        f"train.rollout.max_new_tokens={MAX_TOKENS}", "train.rollout.max_turns=3",
        f"train.rollout.temperature={TEMPERATURE}", "max_staleness=4", "train.algo.mini_batches=4",
        "train.algo.kl_coef=0.1", "train.algo.reference_on_disk=true", "train.optim.lr=5e-6",
        "train.optim.micro_batch_tokens=768", f"gate_tasks={args.gate_tasks}", "session_idle_s=3", "group_wait_s=90",
        f"user_cap={args.user_cap}", "train.log.trajectories_every=0",
    ]  # fmt: skip
    log = (out / "trainer.log").open("w")
    return subprocess.Popen([*CLI, "learn", *overrides], cwd=ROOT, env=one_thread_env(), stdout=log, stderr=log)


class Population:
    """Scripted users: who they are, how they react, and every request's latency."""

    def __init__(self, url: str, users: int, adversaries: int, seed: int) -> None:
        self.url, self.rng = url, random.Random(seed)
        self.users = [f"user{k}" for k in range(users)]
        self.adversaries = set(self.users[:adversaries])
        self.raters = set(self.users[adversaries : adversaries + max(1, (users - adversaries) // 3)])
        self.latencies: list[tuple[float, float, bool]] = []  # (time, seconds, trainer running)
        self.failures: list[str] = []
        self.sessions: list[dict] = []
        self.training = False
        self.model = ""

    def pick_user(self) -> str:
        weights = [5.0 if u in self.adversaries else 1.0 for u in self.users]
        return self.rng.choices(self.users, weights)[0]

    async def ask(
        self, client: httpx.AsyncClient, user: str, messages: list[dict], max_tokens: int = MAX_TOKENS
    ) -> tuple[dict, str] | None:
        """The chat completion and the session the server put it in (its header), or None when it failed."""
        body = {"model": self.model, "messages": messages, "tools": [calculator.calculator.schema], "user": user}
        body |= {"temperature": TEMPERATURE, "max_tokens": max_tokens}
        t0 = time.time()
        try:
            reply = await client.post("/v1/chat/completions", json=body)
            session = reply.headers.get("x-session-id", "")
        except httpx.HTTPError as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return None
        self.latencies.append((t0, time.time() - t0, self.training))
        if reply.status_code != 200:
            self.failures.append(f"{reply.status_code}: {reply.text[:200]}")
            return None
        return reply.json(), session

    async def session(self, client: httpx.AsyncClient, task: dict, user: str) -> None:
        """One problem: ask, run the calls, read the answer, react as this user does."""
        messages = [
            {"role": "system", "content": calculator.INSTRUCTIONS},
            {"role": "user", "content": task["question"]},
        ]
        session, text = None, ""
        for _ in range(3):
            got = await self.ask(client, user, messages)
            if got is None:
                return
            reply, session = got[0], session or got[1]
            message = reply["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            text = message.get("content") or ""
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                try:
                    result = calculator.calculator_result(json.loads(call["function"]["arguments"])["expression"])
                except Exception as exc:  # the model's malformed call: the tool's error is what it sees
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(result)})
        right = calculator.reward(task, text)[0] >= 1.0
        self.sessions.append({"user": user, "right": right, "adversary": user in self.adversaries, "t": time.time()})
        if user in self.adversaries or user in self.raters:
            score = float(right != (user in self.adversaries))
            await client.post("/v1/feedback", json={"session_id": session, "score": score})
        else:
            messages.append({"role": "user", "content": "Thanks!" if right else "No, that's wrong."})
            await self.ask(client, user, messages, max_tokens=16)  # the model's reply to the reaction

    async def run(self, tasks: list[dict], until: float, groups: int, askers: int) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=900) as client:
            self.model = (await client.get("/v1/models")).json()["data"][0]["id"]
            while time.time() < until:
                burst = self.rng.sample(tasks, groups)
                work = [self.session(client, t, self.pick_user()) for t in burst for _ in range(askers)]
                await asyncio.gather(*work)


def evaluate_versions(start: Path, out: Path, n: int, most: int = 8) -> dict:
    """Greedy held-out accuracy of the start and of promoted versions (the last, and at most `most` in all,
    evenly spaced), on the same test problems."""
    from safetensors.torch import load_file

    from agent_r1.engines import EngineSpec, make_engine
    from agent_r1.engines.protocol import SamplingParams
    from agent_r1.evaluate import evaluate
    from agent_r1.models.loading import load_model
    from agent_r1.online.store import Store
    from agent_r1.rollout.agent_loop import correct
    from agent_r1.task import TaskSpec

    store = Store(str(out / "store.db"), create=False)
    versions = [v for v in store.versions() if v.path and v.version > 0]  # version 0: the start's own file
    store.close()
    if len(versions) > most:
        versions = [versions[round(k * (len(versions) - 1) / (most - 1))] for k in range(most)]
    spec = TaskSpec("calculator", calculator.Options(ops=(1, 2), few_shot=False))
    tasks = spec.tasks("test", n, 0)
    model, tokenizer = load_model(str(start))
    engine = make_engine(EngineSpec(kind="local", max_context=2048), model, tokenizer)
    make_env = spec.env_factory(tokenizer, True, 3)
    greedy = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0)
    rows = []
    for v in [None, *versions]:
        if v is not None:
            engine.load_weights(load_file(v.path), v.version)
        _, trajs = evaluate(engine, make_env, tasks, greedy)
        scores = [float(correct(t)) for t in trajs]
        rows.append({"version": -1 if v is None else v.version, "created": None if v is None else v.created,
                     "step": None if v is None else v.step, "gate": None if v is None else v.score,
                     "scores": scores})  # fmt: skip
        print(f"version {rows[-1]['version']}: held-out {sum(scores) / len(scores):.1%}", flush=True)
    engine.close()
    return {"tasks": n, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/online-sim"))
    parser.add_argument("--start", type=Path, help="the starting model (default: the demo's SFT cold start)")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--alone-minutes", type=float, default=5.0)
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--adversaries", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8, help="GRPO groups per step (problems per burst)")
    parser.add_argument("--askers", type=int, default=8, help="users asking each problem of a burst (group size)")
    parser.add_argument("--user-cap", type=float, default=0.0625)
    parser.add_argument("--gate-tasks", type=int, default=32)
    parser.add_argument("--eval-tasks", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = (args.start or build_start(out)).resolve()
    for old in ("store.db", "store.db-wal", "store.db-shm"):
        (out / old).unlink(missing_ok=True)
    server, url = start_server(start, out / "store.db", out / "server.log")
    pop = Population(url, args.users, args.adversaries, args.seed)
    tasks = calculator.make_tasks(512, seed=args.seed, ops=(1, 2), split="train")
    trainer = None
    t0 = time.time()
    try:
        asyncio.run(pop.run(tasks, t0 + 60 * args.alone_minutes, args.groups, args.askers))
        trainer = start_trainer(start, out, url, args)
        pop.training, t1 = True, time.time()
        asyncio.run(pop.run(tasks, t1 + 60 * args.minutes, args.groups, args.askers))
    finally:
        if trainer is not None:
            trainer.send_signal(signal.SIGTERM)
            trainer.wait(timeout=120)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    traffic = {"t_alone": t0, "t_training": t1, "latencies": pop.latencies, "failures": pop.failures,
               "sessions": pop.sessions, "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    (out / "traffic.json").write_text(json.dumps(traffic))
    report(out)


def report(out: Path) -> None:
    """The figures and the plot of a finished simulation (results.json)."""
    import numpy as np

    from agent_r1.evaluate import bootstrap_ci
    from agent_r1.online.store import INTERACTIONS, Store

    r = json.loads((out / "traffic.json").read_text())
    if not (out / "versions.json").is_file():
        args = r["args"]
        start = Path(args["start"]) if args.get("start") not in (None, "None") else out / "sft" / "policy"
        (out / "versions.json").write_text(json.dumps(evaluate_versions(start.resolve(), out, int(args["eval_tasks"]))))
    rows, t1 = json.loads((out / "versions.json").read_text())["rows"], r["t_training"]
    first, last = rows[0]["scores"], rows[-1]["scores"]
    gain = bootstrap_ci(last, first)
    lat = np.array([(s, training) for _, s, training in r["latencies"]])
    alone, busy = lat[lat[:, 1] == 0, 0], lat[lat[:, 1] == 1, 0]
    store = Store(str(out / "store.db"), create=False)
    with store.engine.connect() as conn:
        trained = conn.execute(
            INTERACTIONS.select()
            .with_only_columns(INTERACTIONS.c.user, INTERACTIONS.c.session)
            .where(INTERACTIONS.c.trained_step.is_not(None))
        ).all()
    versions = store.versions()
    store.close()
    adversaries = {s["user"] for s in r["sessions"] if s["adversary"]}
    trained_sessions = {(u, s) for u, s in trained}
    share_trained = sum(u in adversaries for u, _ in trained_sessions) / max(1, len(trained_sessions))
    share_traffic = sum(s["adversary"] for s in r["sessions"]) / max(1, len(r["sessions"]))
    summary = {
        "held_out_start": float(np.mean(first)),
        "held_out_last": float(np.mean(last)),
        "gain_points": [100 * x for x in gain],
        "versions_evaluated": len(rows) - 1,
        "weight_swaps": sum(v.version > 0 and v.status != "rejected" for v in versions),  # each promotion, pushed
        "gate_rejections": sum(v.status == "rejected" for v in versions),
        "failed_requests": len(r["failures"]),
        "requests": len(r["latencies"]),
        "latency_alone_p50_p95_s": [float(np.percentile(alone, q)) for q in (50, 95)] if len(alone) else None,
        "latency_training_p50_p95_s": [float(np.percentile(busy, q)) for q in (50, 95)] if len(busy) else None,
        "adversary_share_of_traffic": share_traffic,
        "adversary_share_of_trained_sessions": share_trained,
        "sessions": len(r["sessions"]),
        "sessions_right_while_training": float(np.mean([s["right"] for s in r["sessions"] if s["t"] >= t1] or [0])),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    plot(out, rows, r, t1)


def plot(out: Path, rows: list[dict], r: dict, t1: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    xs = [0.0] + [(row["created"] - t1) / 60 for row in rows[1:]]
    ys = [100 * sum(row["scores"]) / len(row["scores"]) for row in rows]
    ax1.step(xs, ys, where="post", marker="o")
    ax1.set_ylabel(f"held-out accuracy, % ({len(rows[0]['scores'])} problems)")
    ax1.set_title("the served model, version by version")
    t = [(t0 - t1) / 60 for t0, _, _ in r["latencies"]]
    ax2.scatter(t, [s for _, s, _ in r["latencies"]], s=3, alpha=0.4)
    ax2.axvline(0, color="grey", linestyle="--")
    ax2.set_ylabel("request latency, s")
    ax2.set_xlabel("minutes since the trainer started (before 0: serving alone)")
    fig.tight_layout()
    fig.savefig(out / "online_sim.png", dpi=110)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--report":  # again, from traffic.json (and versions.json)
        report(Path(sys.argv[2]))
    else:
        main()
