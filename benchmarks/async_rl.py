"""Asynchronous RL on a latency-bound task: lockstep against rollout.max_staleness = 1 and 2.

The task is the trainer tests' toy (a tiny Llama over 64 ids; the reward is the share of sampled ids
below 32, which GRPO learns in a dozen steps), made latency-bound: every turn ends in a tool call that
takes a log-normal time, median 1 s, sigma 0.9, capped at 8 s (p95 4.4 s, p99 8 s), as a search API or a
sandbox would. Each arm runs the same seeds; the table gives steps per hour, the reward of the first and
last steps, the trained policy's reward (its own samples on the 16 tasks x 8, tools without latency:
what the run learned, where the batch rewards lag by the samples' age), and the trainer's and the
engine's idle fractions. A JSON line per run goes to --out.

    python benchmarks/async_rl.py [--steps 16] [--seeds 0,1] [--arms 0,1,2] [--out runs/bench/async_rl.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from pathlib import Path

from agent_r1.config import load_config
from agent_r1.env.base import Env, StepResult
from agent_r1.models import resolve_model_path
from agent_r1.models.onednn import use_onednn
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.rl import train
from agent_r1.types import Observation, Termination

VOCAB = 64
TASKS = [{"ids": [10 + i, 50, 51]} for i in range(16)]


def latency(rng: random.Random) -> float:
    """A tool call's seconds: log-normal, median 1 s, sigma 0.9, at most 8 s."""
    return min(8.0, math.exp(rng.gauss(0.0, 0.9)))


class SlowToolEnv(Env):
    """Two turns; each answer goes to a tool that takes `latency()` seconds; reward = share of ids < 32."""

    rng = random.Random(0)

    async def reset(self, task):
        self.turn, self.hits, self.context = 0, [], list(task["ids"])
        return Observation(token_ids=list(self.context))

    def delay(self) -> float:
        return latency(SlowToolEnv.rng)

    async def step(self, action):
        self.turn += 1
        self.hits += [t < VOCAB // 2 for t in action.token_ids]
        await asyncio.sleep(self.delay())  # the tool call
        if self.turn == 2:
            reward = sum(self.hits) / max(1, len(self.hits))
            return StepResult(None, reward, True, {"termination": Termination.ANSWERED})
        self.context = self.context + action.token_ids + [40, 41]
        return StepResult(Observation(token_ids=list(self.context)), None, False, {})


class FastToolEnv(SlowToolEnv):
    """SlowToolEnv with tools that answer at once: to measure a trained policy, not the latency."""

    def delay(self) -> float:
        return 0.0


def policy_reward(model, tokenizer, samples: int = 8) -> float:
    """The mean reward of `model`'s own episodes (temperature 1, fixed seeds) on every task."""
    from agent_r1.engines.cpu.local_engine import LocalEngine
    from agent_r1.engines.protocol import SamplingParams
    from agent_r1.rollout.agent_loop import AgentEnvLoop

    loop = AgentEnvLoop(LocalEngine(model, tokenizer), FastToolEnv, SamplingParams(max_new_tokens=6), seed=12345)
    trajs = loop.run_sync(TASKS, samples)
    return sum(t.reward for t in trajs) / len(trajs)


def tiny_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    use_onednn(model)
    return model


def run(k: int, seed: int, steps: int, tokenizer) -> dict:
    SlowToolEnv.rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(TrainConfig, None, [
            f"run_dir={tmp}/run", f"steps={steps}", f"seed={seed}", "optim.lr=1e-2", "rollout.tasks_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "prompt_format=chat", f"rollout.max_staleness={k}",
            f"save_every={steps}", "log.trajectories_every=0",
        ])  # fmt: skip
        t0 = time.perf_counter()
        model = tiny_model(seed)
        hist = train(cfg, model=model, tokenizer=tokenizer, make_env=SlowToolEnv, tasks=TASKS)
        wall = time.perf_counter() - t0

    def mean(key: str) -> float:
        values = [h[key] for h in hist if key in h]
        return sum(values) / max(1, len(values))

    return {
        "max_staleness": k, "seed": seed, "steps": steps, "wall_s": round(wall, 1),
        "steps_per_hour": round(steps / wall * 3600, 1), "rewards": [round(h["reward_mean"], 4) for h in hist],
        "elapsed_s": [round(sum(h["time/step"] for h in hist[: i + 1]), 2) for i in range(len(hist))],
        "trainer_idle_frac": round(mean("time/trainer_idle_frac"), 3),
        "engine_idle_frac": round(mean("time/engine_idle_frac"), 3),
        "version_lag_mean": round(mean("async/version_lag_mean"), 3),
        "spanning_versions": round(mean("async/episodes_spanning_versions"), 3),
        "dropped_groups": sum(h.get("async/dropped_groups", 0) for h in hist),
        "policy_reward": round(policy_reward(model, tokenizer), 4),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--arms", default="0,1,2", help="values of rollout.max_staleness")
    parser.add_argument("--out", default="runs/bench/async_rl.jsonl")
    args = parser.parse_args()
    from transformers import AutoTokenizer  # not at the top: run as a script, ./kernels.py shadows `kernels`

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in map(int, args.seeds.split(",")):
        for k in map(int, args.arms.split(",")):
            r = run(k, seed, args.steps, tokenizer)
            results.append(r)
            with out.open("a") as f:
                f.write(json.dumps(r) + "\n")
    print(f"{'k':>2} {'seed':>4} {'wall s':>7} {'steps/h':>8} {'reward 1-4':>10} {'reward last 4':>13} "
          f"{'policy':>6} {'trainer idle':>12} {'engine idle':>11} {'lag':>5} {'dropped':>7}")  # fmt: skip
    for r in results:
        first, last = sum(r["rewards"][:4]) / 4, sum(r["rewards"][-4:]) / 4
        print(f"{r['max_staleness']:>2} {r['seed']:>4} {r['wall_s']:>7.1f} {r['steps_per_hour']:>8.0f} {first:>10.3f} "
              f"{last:>13.3f} {r['policy_reward']:>6.3f} {r['trainer_idle_frac']:>12.2f} "
              f"{r['engine_idle_frac']:>11.2f} {r['version_lag_mean']:>5.2f} {r['dropped_groups']:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
