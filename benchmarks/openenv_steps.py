"""What an OpenEnv server costs a rollout: env steps per second and milliseconds per step, through
OpenEnvEnv and OpenEnv's own WebSocket client, against the example env served by uvicorn on 127.0.0.1.

    python benchmarks/openenv_steps.py --episodes 64

The policy is a scripted binary search (no model), so the time is the env's, the client's and our
adapter's: prompt building, call parsing, one WebSocket round trip per step. Episodes run concurrently
(as a rollout batch does), each in its own session."""

from __future__ import annotations

import argparse
import re
import time

from transformers import AutoTokenizer

from agent_r1.engines.protocol import GenerateOutput, SamplingParams, no_cohort
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.models import resolve_model_path
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.tasks.openenv import OpenEnvEnv, local_server, stop_local_servers


class BinarySearch:
    """Guesses the middle of what the game's hints (read back from the prompt) leave."""

    max_context = 8192
    cohort = staticmethod(no_cohort)

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    async def generate(self, prompts, params):
        low, high = 1, 100
        for hint, n in re.findall(r"it is (higher|lower) than (\d+)", self.tok.decode(prompts[0])):
            low, high = (max(low, int(n) + 1), high) if hint == "higher" else (low, min(high, int(n) - 1))
        out = f'<tool_call>{{"name": "act", "arguments": {{"number": {(low + high) // 2}}}}}</tool_call>'
        ids = self.tok.encode(out)
        return [GenerateOutput(ids, [0.0] * len(ids), out, "stop", len(prompts[0]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    t0 = time.perf_counter()
    url = local_server("examples.openenv_guess:app")
    started = time.perf_counter() - t0
    fmt = ChatFormat(tokenizer)
    loop = AgentEnvLoop(BinarySearch(tokenizer), lambda: OpenEnvEnv(url, fmt), SamplingParams())
    try:
        loop.run_sync([{"seed": s} for s in range(4)])  # warm: the client's import, the schema
        t0 = time.perf_counter()
        trajs = loop.run_sync([{"seed": s} for s in range(args.episodes)])
        seconds = time.perf_counter() - t0
    finally:
        stop_local_servers()
    steps = sum(len(t.steps) for t in trajs)
    solved = sum(t.reward == 1.0 for t in trajs)
    print(f"server start {started:.1f} s; {args.episodes} concurrent episodes, {steps} env steps, {solved} solved")
    print(f"{steps / seconds:.0f} steps/s, {1000 * seconds / steps:.2f} ms per step (wall, all episodes together)")


if __name__ == "__main__":
    main()
