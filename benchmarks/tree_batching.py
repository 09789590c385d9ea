"""Tokens the update computes on a sub-agent workload: an episode as a tree, its shared prefixes computed once.

A harness-like agent program (a long system prompt with four tools, a main line that spawns a sub-agent, goes
on with its report, compacts its context and retries a request) runs through the gateway with the bundled
policy sampling every answer. Its episodes become rows (`merge_trajectory`: a row per branch), and the rows
are packed as the update packs them. Reported, from one run: the steps that attached to an earlier prefix
(merged or branched), the tokens in the rows (what row-by-row computation computes) against the tokens the
packed micro-batches compute, and the log-probs, loss and gradients of the packed forward against each row
run alone, with both timings side by side.

    python benchmarks/tree_batching.py            # writes runs/bench/tree_batching.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOOLS = [  # a coding harness's tools, as OpenAI function specs
    {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {arg: {"type": "string", "description": f"the {arg}"} for arg in args},
        "required": list(args)}}}
    for name, description, args in [
        ("bash", "Run a shell command in the repository and return its output. Use it to run tests, list "
         "files and inspect the environment; never to edit files.", ("command",)),
        ("read", "Read a file of the repository, with line numbers.", ("path",)),
        ("edit", "Replace one exact occurrence of old_text by new_text in a file.", ("path", "old_text", "new_text")),
        ("task", "Start a sub-agent on a self-contained research question; it answers with a report.", ("prompt",)),
    ]
]  # fmt: skip
RULES = [
    "Read the code before you change it.", "Run the tests after every change.", "Keep changes small.",
    "Explain what you found before you edit.", "Never delete a test to make it pass.",
    "Prefer the standard library.", "Ask a sub-agent when a question needs much reading.",
]  # fmt: skip
MAIN = "You are a coding agent working in a Python repository.\n" + "\n".join(f"- {r}" for r in RULES * 12)
SUB = "You are a research sub-agent. Read what you need and answer with a short report.\n" + "\n".join(
    f"- {r}" for r in RULES[:3] * 8
)
OUTPUT = "\n".join(f"tests/test_module_{i}.py::test_case_{j} PASSED" for i in range(4) for j in range(6))


def harness(task: dict, base_url: str, api_key: str) -> str:
    """main line -> sub-agent (3 turns) -> main goes on -> compaction -> 2 turns -> a retry."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    def ask(messages: list[dict]) -> dict:
        reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        return reply.choices[0].message.model_dump(exclude_none=True)

    def observe(messages: list[dict], answer: dict, text: str) -> None:
        """The answer as the program got it, then what its tools printed (as one user turn)."""
        messages += [answer, {"role": "user", "content": text}]

    main = [{"role": "system", "content": MAIN}, {"role": "user", "content": task["question"]}]
    for k in range(2):
        observe(main, ask(main), f"Output of step {k}:\n{OUTPUT}")
    sub = [{"role": "system", "content": SUB}, {"role": "user", "content": "Where is the parser defined?"}]
    for k in range(3):
        observe(sub, ask(sub), f"Read {k}:\n{OUTPUT}")
    observe(main, ask(main), f"Sub-agent report: the parser is in parser.py.\n{OUTPUT}")
    observe(main, ask(main), f"Output of step 3:\n{OUTPUT}")
    compacted = [{"role": "system", "content": MAIN}, {"role": "user", "content": "Summary so far: " + OUTPUT}]
    for k in range(2):
        observe(compacted, ask(compacted), f"Output after compaction {k}:\n{OUTPUT}")
    ask(compacted)  # a request that timed out on the program's side ...
    return ask(compacted).get("content") or ""  # ... and its retry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--micro-batch-tokens", type=int, default=32768, help="one tree a micro-batch")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/tree_batching.json"))
    args = parser.parse_args()

    import torch

    from agent_r1.engines.cpu.local_engine import LocalEngine
    from agent_r1.engines.protocol import SamplingParams
    from agent_r1.gateway import ProgramEnvFactory
    from agent_r1.models.loading import load_model
    from agent_r1.rollout.agent_loop import AgentEnvLoop, summarize
    from agent_r1.rollout.merge import merge_trajectory
    from agent_r1.trainer.batching import pack, token_logprobs
    from agent_r1.trainer.rows import build_rows

    torch.manual_seed(0)
    model, tokenizer = load_model("default")
    model.eval()
    engine = LocalEngine(model, tokenizer, seed=0, max_context=8192)
    factory = ProgramEnvFactory(tokenizer, function=harness, max_turns=16, timeout_s=600)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    tasks = [{"question": f"Fix the failing test number {i} in the parser."} for i in range(args.episodes)]
    t0 = time.perf_counter()
    trajs = AgentEnvLoop(engine, factory, params, seed=0).run_sync(tasks)
    rollout_s = time.perf_counter() - t0
    errors = [t.error for t in trajs if t.error]
    if errors:
        raise SystemExit(f"an episode failed: {errors[0]}")
    metrics = summarize(trajs)
    later = sum(metrics[f"gateway/{k}_steps"] for k in ("merged", "branched", "fresh"))
    attached = (metrics["gateway/merged_steps"] + metrics["gateway/branched_steps"]) / later
    sequences = [merge_trajectory(t) for t in trajs]
    rows, _ = build_rows(trajs, sequences)
    for r in rows:  # advantages of either sign, so the gradient is a policy gradient's
        r.adv = torch.where(r.mask > 0, torch.randn(len(r.input_ids)), torch.zeros(len(r.input_ids)))
    in_rows = sum(len(r.input_ids) for r in rows)

    def run(micro_batches) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], float, int]:
        """Each row's log-probs, the loss's gradients, the seconds of forward + backward, tokens computed."""
        model.zero_grad(set_to_none=True)
        out: dict[int, torch.Tensor] = {}
        t = time.perf_counter()
        for mb in micro_batches:
            logp, _, _ = token_logprobs(model, mb)
            (-(logp * mb.adv).sum()).backward()
            for row, part in zip(mb.rows, logp.detach().split(mb.row_lens), strict=True):
                out[id(row)] = part
        seconds = time.perf_counter() - t
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return [out[id(r)] for r in rows], grads, seconds, sum(mb.num_tokens for mb in micro_batches)

    shared_lp, shared_g, shared_s, computed = run(pack(rows, args.micro_batch_tokens))
    alone_lp, alone_g, alone_s, alone_tokens = run([pack([r], args.micro_batch_tokens)[0] for r in rows])
    assert alone_tokens == in_rows
    lp_diff = max(float((a - b).abs().max()) for a, b in zip(shared_lp, alone_lp, strict=True))
    g_diff = max(float((shared_g[n] - g).abs().max()) for n, g in alone_g.items())
    g_scale = max(float(g.abs().max()) for g in alone_g.values())
    result = {
        "episodes": len(trajs),
        "steps": sum(len(t.steps) for t in trajs),
        "rows": len(rows),
        "attached_share": attached,
        "merged": metrics["gateway/merged_steps"],
        "branched": metrics["gateway/branched_steps"],
        "fresh": metrics["gateway/fresh_steps"],
        "tokens_in_rows": in_rows,
        "tokens_computed": computed,
        "computed_share": computed / in_rows,
        "logprob_max_abs_diff": lp_diff,
        "grad_max_abs_diff": g_diff,
        "grad_max_abs": g_scale,
        "seconds_shared": shared_s,
        "seconds_row_by_row": alone_s,
        "rollout_seconds": rollout_s,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    # run as a script, this directory heads sys.path, and its kernels.py would shadow the `kernels` package that
    # transformers probes for
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(ROOT))
    main()
