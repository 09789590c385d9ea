"""Context management (docs/context.md): how an episode's compute grows with its turns under each strategy,
and what evals of the strategies scored.

    python benchmarks/context.py scaling [--budget 640] [--documents 6 12 24 48]

replays `task=dossiers`' scripted demonstration (read every document in order, then answer) through the
env under each strategy, for reads of growing length, and prints per episode: the turns, the prompt
tokens a model without a cache would process (the sum of every step's prompt), and the training tokens
(the rows `merge_trajectory` makes: what the update computes). No model is needed.

    python benchmarks/context.py size [--documents 8] [--records 2] [--budget 560] [--summary-tokens 128]

checks a task size for the learned-vs-fixed comparison: on the held-out tasks, under each strategy, how
often the scripted demonstration's final prompt still shows the first person's record or a line carrying
its value (a fixed strategy should never; a summary or a note always), and its turns and training tokens.

    python benchmarks/context.py decisions MODEL [--strategy memory] [--tasks 32]

teacher-forces the scripted demonstrations of held-out tasks through a policy under a strategy and
prints, for each kind of turn (read on, note, answer), how often the policy's greedy turn is the
demonstration's turn token for token: which decisions SFT taught, in a minute instead of an eval.

    python benchmarks/context.py summary runs/ctx/eval_*.jsonl

prints each eval's accuracy with a bootstrap 95% interval over tasks, and its mean turns, training
tokens per episode and longest training row (from the trajectory records of `agent-r1 eval out=FILE`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agent_r1.evaluate import bootstrap_ci
from agent_r1.models import resolve_model_path
from agent_r1.observe.records import read_records
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.task import TaskSpec
from agent_r1.tasks import dossiers
from agent_r1.trainer.sft import replay_demo
from agent_r1.types import Trajectory

STRATEGIES = ("append", "truncate", "elide", "summarize", "memory")


def scaling(budget: int, documents: list[int], records: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    print(f"budget {budget} tokens ('append' has none), {records} records a document; per episode:")
    print("| strategy | documents read | turns | prompt tokens | training tokens | training tokens a turn |")
    print("|---|---|---|---|---|---|")
    for strategy in STRATEGIES:
        for n in documents:
            context = {} if strategy == "append" else {"strategy": strategy, "budget": budget, "summary_tokens": 128}
            spec = TaskSpec.from_raw({"name": "dossiers", "documents": n, "records": records, "context": context},
                                     "task", TaskSpec())  # fmt: skip
            task = dossiers.make_task(0, n, records)
            task["found_in"][1] = n  # read every document
            demo = dossiers.demo(task, memory=strategy == "memory")
            steps = replay_demo(demo, task, spec.env_factory(tokenizer, True, 4 * n)(), dossiers.summary)
            rows = merge_trajectory(Trajectory(task, "t", "g", steps))
            prompts = sum(len(s.prompt_ids) for s in steps)
            trained = sum(len(r.input_ids) for r in rows)
            print(f"| {strategy} | {n} | {len(steps)} | {prompts:,} | {trained:,} | {trained / len(steps):,.0f} |")


def size(documents: int, records: int, budget: int, summary_tokens: int, num_tasks: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    tasks = dossiers.tasks(dossiers.Options(documents=documents, records=records), "test", num_tasks)
    print(f"{documents} documents of {records} records, budget {budget}, summary_tokens {summary_tokens}; "
          f"{len(tasks)} held-out tasks, scripted demonstrations:")  # fmt: skip
    print("| strategy | first value in view at the answer | turns | training tokens a demo | longest prompt |")
    print("|---|---|---|---|---|")
    for strategy in STRATEGIES[1:]:
        context = {"strategy": strategy, "budget": budget, "summary_tokens": summary_tokens}
        spec = TaskSpec.from_raw({"name": "dossiers", "documents": documents, "records": records,
                                  "context": context}, "task", TaskSpec())  # fmt: skip
        seen, turns, trained, longest = 0, [], 0, 0
        for task in tasks:
            demo = dossiers.demo(task, memory=strategy == "memory")
            steps = replay_demo(demo, task, spec.env_factory(tokenizer, True, 4 * documents)(), dossiers.summary)
            prompt = tokenizer.decode(steps[-1].prompt_ids)
            first = task["people"][0]
            seen += f"{first} lives" in prompt or f"{first}'s {task['attribute']} is {task['values'][0]}" in prompt
            turns.append(len(steps))
            trained += sum(len(r.input_ids) for r in merge_trajectory(Trajectory(task, "t", "g", steps)))
            longest = max(longest, *(len(s.prompt_ids) for s in steps))
        print(f"| {strategy} | {seen} of {len(tasks)} | {min(turns)}–{max(turns)} | {trained / len(tasks):,.0f} "
              f"| {longest:,} |")  # fmt: skip


def decisions(model: str, strategy: str, documents: int, records: int, budget: int, summary_tokens: int,
              num_tasks: int) -> None:  # fmt: skip
    import torch

    from agent_r1.models import load_model

    policy, tokenizer = load_model(model)
    policy.eval()
    context = {"strategy": strategy, "budget": budget, "summary_tokens": summary_tokens}
    spec = TaskSpec.from_raw({"name": "dossiers", "documents": documents, "records": records, "context": context},
                             "task", TaskSpec())  # fmt: skip
    right: dict[str, list[int]] = {}
    for task in dossiers.tasks(dossiers.Options(documents=documents, records=records), "test", num_tasks):
        demo = dossiers.demo(task, memory=strategy == "memory")
        steps = replay_demo(demo, task, spec.env_factory(tokenizer, True, 4 * documents)(), dossiers.summary)
        for step in steps:
            kind = ("note" if '"note"' in step.text else "answer" if "<answer>" in step.text
                    else "summary" if "<summary>" in step.text else "read")  # fmt: skip
            ids = torch.tensor([step.prompt_ids + step.response_ids])  # [1, prompt + action]
            with torch.no_grad():
                greedy = policy(ids).logits[0, len(step.prompt_ids) - 1 : -1].argmax(-1)  # [action]
            right.setdefault(kind, []).append(int(greedy.tolist() == step.response_ids))
    print(f"{model}, {strategy}: the greedy turn equals the demonstration's, by kind of turn")
    print("| turn | turns | greedy = demonstration |")
    print("|---|---|---|")
    for kind, hits in sorted(right.items()):
        print(f"| {kind} | {len(hits)} | {100 * sum(hits) / len(hits):.1f}% |")


def summary(paths: list[Path]) -> None:
    print("| eval | episodes | accuracy [95% interval] | turns | training tokens | longest row |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        records = list(read_records(path))
        scores = [float((r.get("metrics") or {}).get("reward/correct", r["reward"] >= 1.0)) for r in records]
        mean, low, high = bootstrap_ci(scores)
        turns = sum(len(r["turns"]) for r in records) / len(records)
        tokens = sum(len(row["ids"]) for r in records for row in r["rows"]) / len(records)
        largest = max(max((len(row["ids"]) for row in r["rows"]), default=0) for r in records)
        print(f"| {path.stem} | {len(records)} | {100 * mean:.1f}% [{100 * low:.1f}, {100 * high:.1f}] | {turns:.1f} "
              f"| {tokens:,.0f} | {largest:,} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scaling")
    s.add_argument("--budget", type=int, default=640)
    s.add_argument("--documents", type=int, nargs="+", default=[6, 12, 24, 48])
    s.add_argument("--records", type=int, default=4)
    z = sub.add_parser("size")
    z.add_argument("--documents", type=int, default=8)
    z.add_argument("--records", type=int, default=2)
    z.add_argument("--budget", type=int, default=560)
    z.add_argument("--summary-tokens", type=int, default=128)
    z.add_argument("--tasks", type=int, default=64)
    d = sub.add_parser("decisions")
    d.add_argument("model")
    d.add_argument("--strategy", choices=STRATEGIES[1:], default="memory")
    d.add_argument("--documents", type=int, default=8)
    d.add_argument("--records", type=int, default=2)
    d.add_argument("--budget", type=int, default=560)
    d.add_argument("--summary-tokens", type=int, default=128)
    d.add_argument("--tasks", type=int, default=32)
    e = sub.add_parser("summary")
    e.add_argument("paths", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "scaling":
        scaling(args.budget, args.documents, args.records)
    elif args.command == "size":
        size(args.documents, args.records, args.budget, args.summary_tokens, args.tasks)
    elif args.command == "decisions":
        decisions(args.model, args.strategy, args.documents, args.records, args.budget, args.summary_tokens, args.tasks)
    else:
        summary(args.paths)


if __name__ == "__main__":
    main()
