"""`serve --learn` under SIGKILL, and the interaction store's throughput.

    python benchmarks/chaos_online.py --kills 20 --out runs/chaos-online
    python benchmarks/chaos_online.py --kills 0 --swaps 20
    python benchmarks/chaos_online.py --kills 0 --throughput 2000 [--postgres postgresql://user@host:port/db]

Kills: a server on the bundled model (or `--model`) takes requests from `--clients` threads; at a random
moment it is SIGKILLed and started again on the same store, `--kills` times. Every answer a client got
(HTTP 200) must be in the store afterwards: an acknowledged interaction is one the store had committed.

Swaps: `--swaps` new weights versions pushed to one server, between tokens, while the clients keep asking
(the weights are two files of the model alternated, so every swap really changes what samples); every request
must succeed.

Throughput: `Store.record` of one served answer per call (a 400-token prompt, a 64-token answer, as the
server commits them) from one thread, on SQLite with synchronous=normal and =full, and on PostgreSQL when a
URL is given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

from agent_r1.online.store import Interaction, Store

CLI = [sys.executable, "-m", "agent_r1.cli"]


def start_server(model: str, store: Path) -> tuple[subprocess.Popen, str]:
    args = [f"model={model}", "learn=true", f"online.store={store}", "port=0", "max_tokens=8", "log_level=error"]
    proc = subprocess.Popen([*CLI, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"at (http://\S+)/v1", line):
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def client(url: str, acked: list[str], stop: threading.Event, k0: int, failed: list[str] | None = None) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        name = http.get("/v1/models").json()["data"][0]["id"]
        k = k0
        while not stop.is_set():
            body = {"model": name, "messages": [{"role": "user", "content": f"Say {k}."}], "user": f"u{k % 5}"}
            try:
                reply = http.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                return
            if reply.status_code == 200:
                acked.append(reply.json()["id"])
            elif failed is not None:
                failed.append(f"{reply.status_code}: {reply.text[:200]}")
            k += 1000


def kills(args: argparse.Namespace, out: Path) -> dict:
    store_path = out / "store.db"
    for f in out.glob("store.db*"):
        f.unlink()
    rng, acked, per_kill = random.Random(args.seed), [], []
    for kill in range(args.kills):
        proc, url = start_server(args.model, store_path)
        stop = threading.Event()
        threads = [threading.Thread(target=client, args=(url, acked, stop, c)) for c in range(args.clients)]
        before = len(acked)
        for t in threads:
            t.start()
        time.sleep(rng.uniform(1.0, 4.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        stop.set()
        for t in threads:
            t.join()
        per_kill.append(len(acked) - before)
        print(f"kill {kill + 1}/{args.kills}: {per_kill[-1]} answers acknowledged before it", flush=True)
    store = Store(str(store_path))
    stored = {i.id for i in store.untrained()}
    store.close()
    lost = sorted(set(acked) - stored)
    return {"kills": args.kills, "acknowledged": len(acked), "stored": len(stored), "lost": len(lost)}


def swaps(args: argparse.Namespace, out: Path) -> dict:
    """Weight swaps under load: every request answered, every swap taken."""
    from safetensors.torch import save_file

    from agent_r1.models.loading import load_model

    model, _ = load_model(args.model)
    files = []
    for k, scale in enumerate((1.0, 0.98)):
        state, seen = {}, set()
        for name, t in model.state_dict().items():
            if t.data_ptr() not in seen:  # tied weights once
                seen.add(t.data_ptr())
                state[name] = (t * scale if name.endswith("norm.weight") else t).contiguous()
        files.append(str(out / f"swap-{k}.safetensors"))
        save_file(state, files[-1])
    del model
    for f in out.glob("swaps.db*"):
        f.unlink()
    proc, url = start_server(args.model, out / "swaps.db")
    acked, failed, stop = [], [], threading.Event()
    threads = [threading.Thread(target=client, args=(url, acked, stop, c, failed)) for c in range(args.clients)]
    for t in threads:
        t.start()
    times = []
    try:
        for v in range(1, args.swaps + 1):
            time.sleep(1.0)
            t0 = time.perf_counter()
            body = {"path": files[v % 2], "version": v, "between_tokens": True}
            httpx.post(f"{url}/v1/load_weights", json=body, timeout=600).raise_for_status()
            times.append(time.perf_counter() - t0)
        time.sleep(1.0)
        version = httpx.get(f"{url}/v1/models").json()["data"][0]["weights_version"]
    finally:
        stop.set()
        for t in threads:
            t.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return {"swaps": args.swaps, "served_version": version, "requests_ok": len(acked), "requests_failed": len(failed),
            "swap_s_mean": sum(times) / len(times), "failures": failed[:5]}  # fmt: skip


def throughput(where: str, n: int, sync: str = "normal") -> float:
    """Interactions committed per second, one per transaction."""
    store = Store(where, sync=sync)
    rng = random.Random(0)
    rows = [
        Interaction(
            id=uuid.uuid4().hex, session=f"s{k // 3}", user=f"u{k % 50}", request=uuid.uuid4().hex, served=True,
            turn=k % 3, prompt_ids=[rng.randrange(49152) for _ in range(400)],
            response_ids=[rng.randrange(49152) for _ in range(64)], logprobs=[-rng.random() for _ in range(64)],
            versions=[0] * 64, user_text="a question " * 20, answer="an answer " * 30, continues=uuid.uuid4().hex,
        )
        for k in range(n)
    ]  # fmt: skip
    t0 = time.perf_counter()
    for row in rows:
        store.record([row])
    rate = n / (time.perf_counter() - t0)
    store.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/chaos-online"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--swaps", type=int, default=0, help="weight versions to push while clients ask")
    parser.add_argument("--throughput", type=int, default=0, help="interactions to time the store with")
    parser.add_argument("--postgres", default="", help="also time a PostgreSQL store at this URL")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    if args.kills:
        result["kills"] = kills(args, out)
    if args.swaps:
        result["swaps"] = swaps(args, out)
    if args.throughput:
        rates = {}
        for sync in ("normal", "full"):
            path = out / f"throughput-{sync}.db"
            for f in out.glob(f"throughput-{sync}.db*"):
                f.unlink()
            rates[f"sqlite_{sync}"] = throughput(str(path), args.throughput, sync)
        if args.postgres:
            rates["postgresql"] = throughput(args.postgres, args.throughput)
        result["interactions_per_s"] = rates
    print(json.dumps(result, indent=1))
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
