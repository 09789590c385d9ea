"""Engines side by side on one multi-turn workload: the previous `LocalEngine`, today's, and vLLM's CPU engine.

The workload is what an RL rollout asks of an engine. For each task kind, `--tasks` trajectories run
concurrently (each its own coroutine, as in `AgentEnvLoop`) for `--turns` turns:

* turn 1 samples from the task's real first prompt (system prompt, tool schema, question);
* after every turn, the real tool's result is appended, rendered as `ToolEnv` renders it: the
  calculator's value of the problem, or the BM25 search results for the question cut to 256 tokens.
  The next prompt is the previous prompt + the sampled ids + that tool turn, token for token.

Every trajectory runs every turn whatever the model wrote (the untrained model rarely calls a tool on
its own), so each engine gets the same number of turns and a context that grows the same way.
Sampling is T = 1 with the tasks' stop strings and a per-request seed.

"previous" is `LocalEngine` as it was at `--baseline` (default: the commit before continuous
batching), loaded from git into a module of its own, so all engines run in one process on one model
(each started just before its runs), and run as it ran then (without `TRANSFORMERS_SDPA_FORCE_GQA`,
which `use_onednn` now sets).

`--isolate` runs each engine in a process of its own instead, one after the other, as each runs in a
user's process (an engine that ran second in a shared process took 60-75 s for a search rollout the
same engine took 60-66 s for when it ran first: docs/log/measurements.md).

After the table, a local engine's own clock: seconds in passes that only prefill, only decode, and both
(chunks of prompts beside decoding rows); the rest of a run is sampling, tools and Python.

    python benchmarks/engines.py [--engines previous,local,vllm] [--kinds calculator,search] [--isolate]
                                 [--tasks 64] [--turns 3] [--max-new-tokens 64] [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import prompt_format_for
from agent_r1.env.tool_calls import format_tool_responses
from agent_r1.env.tool_env import truncate_to_tokens
from agent_r1.models.loading import is_chat_model, load_model, resolve_model_path
from agent_r1.tasks import calculator, hotpotqa
from agent_r1.utils.malloc import engine_heap, fix_mmap_threshold

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "53a1f39"  # the last commit with the batch-at-a-time engine


def previous_engine_class(rev: str) -> type:
    """`LocalEngine` (and the KV cache it imports) as they were at git revision `rev`."""
    package = types.ModuleType("agent_r1_previous")
    package.__path__ = []
    sys.modules["agent_r1_previous"] = package
    for name in ("kv_cache", "local_engine"):
        source = subprocess.run(
            ["git", "show", f"{rev}:agent_r1/rollout/{name}.py"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        source = source.replace("from agent_r1.engines.cpu.kv_cache import", "from agent_r1_previous.kv_cache import")
        # its slot attention under a name of its own: under the same name, the one imported last served both
        source = source.replace('"agent_r1_slots"', '"agent_r1_slots_previous"')
        spec = importlib.util.spec_from_loader(f"agent_r1_previous.{name}", loader=None)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        exec(compile(source, f"{rev}:{name}.py", "exec"), module.__dict__)
    return sys.modules["agent_r1_previous.local_engine"].LocalEngine


def workload(kind: str, n: int, fmt, tokenizer):
    """(first prompts, a function giving trajectory i's tool output, stop strings) for a task kind."""
    if kind == "calculator":
        env = calculator.make_env(calculator.Options(), fmt)
        tasks = calculator.make_tasks(n, split="test")
        return [asyncio.run(env.reset(t)).token_ids for t in tasks], lambda i: str(tasks[i]["answer"]), env.stop
    options = hotpotqa.Options()
    env = hotpotqa.make_env(options, fmt)
    tasks = hotpotqa.load(split="test", n=n)
    search = env.tools["search"].fn

    def result(i: int) -> str:
        return truncate_to_tokens(search(tasks[i]["question"]), tokenizer, options.max_tool_tokens)[0]

    return [asyncio.run(env.reset(t)).token_ids for t in tasks], result, env.stop


async def run_trajectories(engine, prompts, tool_output, fmt, params: SamplingParams, turns: int) -> dict:
    """Every trajectory, concurrently, for `turns` turns; returns what was sampled and prefilled."""
    sampled, contexts = [0], []
    cohort = getattr(engine, "cohort", None)  # as AgentEnvLoop does: batches that do not depend on timing
    members = cohort(len(prompts)) if cohort else contextlib.nullcontext()

    async def trajectory(i: int) -> None:
        if cohort:
            together.join()
        prompt = prompts[i]
        for turn in range(turns):
            seeded = dataclasses.replace(params, seed=1000 * i + turn)
            (out,) = await engine.generate([prompt], seeded)
            sampled[0] += len(out.token_ids)
            if turn + 1 < turns:
                tool_turn = [{"role": "user", "content": format_tool_responses([tool_output(i)])}]
                prompt = prompt + out.token_ids + fmt.continuation(tool_turn, after_eos=out.finish_reason == "eos")
        contexts.append(len(prompt) + len(out.token_ids))
        if cohort:
            together.leave()

    with members as together:
        await asyncio.gather(*(trajectory(i) for i in range(len(prompts))))
    return {"sampled": sampled[0], "context": sum(contexts) / len(contexts)}


def bench(engine, prompts, tool_output, fmt, params, turns) -> dict:
    stats = dict(getattr(engine, "stats", {}))
    previous = type(engine).__module__.startswith("agent_r1_previous")
    gqa = os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None) if previous else None  # as it ran then
    start = time.perf_counter()
    try:
        r = asyncio.run(run_trajectories(engine, prompts, tool_output, fmt, params, turns))
    finally:
        if gqa is not None:
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = gqa
    r["seconds"] = time.perf_counter() - start
    after = getattr(engine, "stats", {})
    r["prefilled"] = after.get("prefilled", 0) - stats.get("prefilled", 0)
    r["reused"] = after.get("reused", 0) - stats.get("reused", 0)
    # the engine's own clock: passes that only prefill, only decode, or both (a local engine's)
    r["passes"] = {k: after[k] - stats.get(k, 0) for k in ("prefill_s", "decode_s", "mixed_s") if k in after}
    if isinstance(engine, LocalEngine):
        engine.sleep()  # as the trainer does between rollouts: nothing kept from the previous run
    return r


def start_engine(name: str, model, tokenizer, args: argparse.Namespace):
    """The engine called `name` on the benchmark's model (vLLM loads its own copy of it)."""
    if name == "previous":
        return previous_engine_class(args.baseline)(model, tokenizer, max_batch_size=args.tasks, seed=0)
    if name == "local":
        return LocalEngine(model, tokenizer, max_batch_size=args.tasks, seed=0)
    if name == "vllm":
        from agent_r1.engines.vllm_engine import VLLMEngine

        start = time.perf_counter()
        engine = VLLMEngine(resolve_model_path(args.model), seed=0, max_num_seqs=args.tasks)
        print(f"vLLM started in {time.perf_counter() - start:.1f} s")
        return engine
    raise ValueError(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--engines", default="previous,local,vllm", help="comma-separated: previous, local, vllm")
    parser.add_argument("--kinds", default="calculator,search")
    parser.add_argument("--tasks", type=int, default=64, help="trajectories, all concurrent (the batch)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the previous engine")
    parser.add_argument("--isolate", action="store_true", help="each engine in a process of its own")
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)  # where an isolated run writes its rows
    args = parser.parse_args()
    if unknown := set(args.engines.split(",")) - {"previous", "local", "vllm"}:
        raise SystemExit(f"unknown engine {sorted(unknown)[0]!r}: previous, local or vllm")
    rows = isolated(args) if args.isolate else measure(args)
    if args.rows_out:
        Path(args.rows_out).write_text(json.dumps(rows))
        return
    print("\n| task | engine | seconds | sampled tokens | sampled tok/s | turns/s | context | prefilled | reused |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, name, r in rows:
        turns = args.tasks * args.turns / r["seconds"]
        print(
            f"| {kind} | {name} | {r['seconds']:.1f} | {r['sampled']:,} | {r['sampled'] / r['seconds']:.1f} | "
            f"{turns:.2f} | {r['context']:.0f} | {r['prefilled'] or '-'} | {r['reused'] or '-'} |"
        )
    for kind, name, r in rows:
        if r["passes"]:
            clock = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in r["passes"].items())
            print(f"{kind}, {name}: forward passes {clock} (the rest: sampling, tools, Python)")


def isolated(args: argparse.Namespace) -> list:
    """Each engine's rows from a run of this script in a process of its own, one engine after the other."""
    rows = []
    for name in args.engines.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            argv = [sys.executable, __file__, "--engines", name, "--rows-out", out.name, "--model", args.model]
            for flag in ("kinds", "tasks", "turns", "max_new_tokens", "baseline"):
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            subprocess.run(argv, check=True)
            rows += json.loads(Path(out.name).read_text())
    return rows


def measure(args: argparse.Namespace) -> list:
    """(task kind, engine, measurements) for every engine and kind, all in this process."""
    torch.set_grad_enabled(False)
    fix_mmap_threshold()  # the process as agent-r1's commands run (agent_r1/utils/malloc.py)

    model, tokenizer = load_model(args.model)
    fmt = prompt_format_for(tokenizer, chat=is_chat_model(args.model, tokenizer))
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, fp32")
    print(f"{args.tasks} trajectories at once x {args.turns} turns, <= {args.max_new_tokens} new tokens a turn, T=1")
    workloads = {}
    for kind in args.kinds.split(","):
        prompts, tool_output, stop = workload(kind, args.tasks, fmt, tokenizer)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop=tuple(stop))
        print(f"{kind}: first prompts {sum(map(len, prompts)) / len(prompts):.0f} tokens on average")
        workloads[kind] = prompts, tool_output, params
    rows = []
    # each engine is started just before its runs: a started vLLM slowed the local engine's passes ~15%
    # in this process (the same 64-row workload: 52 s alone, 60 s beside it), so none waits beside another
    for name in args.engines.split(","):
        model.config._attn_implementation = "sdpa"  # each engine sets the attention it runs with
        engine = start_engine(name, model, tokenizer, args)
        # vLLM asks for tcmalloc, which keeps freed memory for reuse; the glibc heap held as for agent-r1's
        # engine (which holds it itself) is the nearest thing in this process
        for kind, (prompts, tool_output, params) in workloads.items():
            with engine_heap() if name == "vllm" else contextlib.nullcontext():
                bench(engine, prompts[:4], tool_output, fmt, params, 1)  # warm-up: kernels, allocations
                r = bench(engine, prompts, tool_output, fmt, params, args.turns)
            rows.append((kind, name, r))
            rate = r["sampled"] / r["seconds"]
            print(f"  {kind:10} {name:9} {r['seconds']:7.1f} s  {rate:6.1f} sampled tok/s", flush=True)
        if name == "vllm":
            engine.close()
        del engine
    return rows


if __name__ == "__main__":
    main()
