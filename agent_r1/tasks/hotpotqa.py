"""HotpotQA with a search tool: multi-hop questions answered after searching a Wikipedia-paragraph corpus.

Data: ../shared/data/hotpotqa/{train,dev}.jsonl (HotpotQA distractor, Hugging Face layout, CC BY-SA
4.0); train.jsonl is the training split, dev.jsonl the held-out one. The retrieval corpus is every
context paragraph of both files, pooled and de-duplicated by title (5,912 passages). Reward: Agent-R1's
`qa_em_and_format` (min(format, 0.5) + answer; docs/algorithms.md), with EM, F1, sub-EM and format logged.
The search index is built (or loaded from its disk cache) lazily, the first time an env needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.data.jsonl import load_tasks
from agent_r1.data.splits import Split, split_of
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import extract_answer, format_tool_call, format_tool_responses
from agent_r1.env.tool_env import ToolEnv, truncate_to_tokens
from agent_r1.retrieval import Passage, Retriever, load_retriever, search_tool
from agent_r1.retrieval.server import RemoteRetriever
from agent_r1.rewards.qa import exact_match, f1_score, qa_em_and_format, qa_format_score, sub_exact_match
from agent_r1.types import Message

DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "hotpotqa"

KIND_KEY = "type"  # eval reports accuracy per question type (bridge, comparison)


@dataclass
class Options:
    data: str | None = None
    """HotpotQA-layout jsonl used whole as the tasks (its paragraphs join the corpus); None = the bundled splits"""
    retriever: str = "bm25"
    """search index, bm25 or dense, or the URL of an `agent-r1 retrieval-server`"""
    max_tool_tokens: int = 256
    """each search result is cut to this many tokens"""

    def __post_init__(self) -> None:
        if self.max_tool_tokens < 1:
            raise ValueError(f"task.max_tool_tokens must be >= 1, got {self.max_tool_tokens}")
        if self.retriever not in ("bm25", "dense") and not self.retriever.startswith(("http://", "https://")):
            raise ValueError(f"task.retriever must be bm25, dense or a retrieval-server URL, got {self.retriever!r}")


INSTRUCTIONS = (
    "Answer the question. Search for the facts you need, one search per turn, as many times as needed. "
    "In every turn first think briefly inside <think></think>, then either call the search tool or give "
    "the final short answer inside <answer></answer>."
)


def load(path: str | Path | None = None, split: Split = "train", n: int | None = None) -> list[dict[str, Any]]:
    """Tasks of one split: question, answer, type, and the titles of the supporting paragraphs.

    test is HotpotQA's dev file; val and train are the fixed hash buckets of its train file (a file
    given as `path` is used whole)."""
    bucketed = path is None and split != "test"  # val and train share the bundled train file
    path = Path(path) if path else DATA_DIR / ("dev.jsonl" if split == "test" else "train.jsonl")
    tasks = []
    for row in load_tasks(path):
        if bucketed and (split_of(row["question"]) == "val") != (split == "val"):
            continue
        if "answer" not in row:
            raise ValueError(f"{path}: a HotpotQA row needs 'question' and 'answer'")
        support = list(dict.fromkeys((row.get("supporting_facts") or {}).get("title", [])))
        tasks.append(
            {"id": row.get("id"), "question": row["question"], "answer": row["answer"],
             "type": row.get("type"), "supporting_titles": support}
        )  # fmt: skip
    return tasks[:n] if n is not None else tasks


def corpus(paths: Sequence[str | Path] | None = None) -> list[Passage]:
    """Every context paragraph of the files, first occurrence per title (titles name Wikipedia pages)."""
    paths = paths or [DATA_DIR / "train.jsonl", DATA_DIR / "dev.jsonl"]
    seen: dict[str, Passage] = {}
    for path in paths:
        for row in load_tasks(path):
            context = row.get("context") or {}
            for title, sentences in zip(context.get("title", []), context.get("sentences", []), strict=True):
                if title not in seen:
                    seen[title] = Passage(title, "".join(sentences).strip())
    return list(seen.values())


def retriever_for(kind: str = "bm25", extra: Sequence[str | Path] = ()) -> Retriever:
    """`bm25` or `dense` over the corpus (the shared files that exist + `extra` files), or the URL of
    an `agent-r1 retrieval-server` that many rollout workers share."""
    if kind.startswith(("http://", "https://")):
        return RemoteRetriever(kind)
    paths = [p for p in (DATA_DIR / "train.jsonl", DATA_DIR / "dev.jsonl") if p.is_file()] + list(extra)
    return _cached_retriever(kind, tuple(str(p) for p in paths))


@functools.cache
def _cached_retriever(kind: str, paths: tuple[str, ...]) -> Retriever:
    return load_retriever(corpus(paths), kind)


def reward(task: dict[str, Any], responses: list[str]) -> tuple[float, dict[str, float]]:
    """Agent-R1's qa_em_and_format over the episode's responses, with EM / F1 / sub-EM of the answer."""
    answer = extract_answer(responses[-1]) if responses else None
    scored = {"em": exact_match, "f1": f1_score, "sub_em": sub_exact_match}
    parts = {name: fn(answer, task["answer"]) if answer is not None else 0.0 for name, fn in scored.items()}
    parts |= {"correct": parts["em"], "format": qa_format_score(responses)}
    return qa_em_and_format(responses, task["answer"]), parts


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    return load(options.data, split=split, n=n)


def retriever(options: Options) -> Retriever:
    """The index the search tool uses (one per process, cached)."""
    return retriever_for(options.retriever, extra=[options.data] if options.data else [])


def make_env(
    options: Options, prompt_format: PromptFormat, max_turns: int = 4, index: Retriever | None = None
) -> ToolEnv:
    """A ToolEnv with `search` (over `index`, default the options' retriever); each tool response is cut to
    `options.max_tool_tokens` tokens."""
    return ToolEnv(
        {"search": search_tool(index or retriever(options))},
        prompt_format,
        reward,
        instructions=INSTRUCTIONS,
        max_turns=max_turns,
        max_tool_tokens=options.max_tool_tokens,
        reward_on="episode",
    )


def demos(options: Options, env: ToolEnv, n: int, seed: int = 0) -> list[list[Message]]:
    """Search demonstrations of the first `n` training questions (tool responses from `env`'s index)."""
    return [demo(t, env) for t in load(options.data, n=n)]


def demo(task: dict[str, Any], env: ToolEnv) -> list[Message]:
    """A cold-start demonstration: search the question, then each supporting paragraph it did not find
    by its title, then answer.

    Searching the question first is what a small model can learn to do on any question; the titles
    of the missing paragraphs are the second hop (they appear in the first results as bridge
    entities). Tool responses come from `env`'s own search tool and token cut, so SFT shows exactly
    what a rollout would see."""
    messages: list[Message] = [{"role": "user", "content": task["question"]}]

    def search(query: str, thought: str) -> str:
        messages.append(
            {
                "role": "assistant",
                "content": f"<think>{thought}</think>\n" + format_tool_call("search", {"query": query}),
            }
        )
        output = env.tools["search"].fn(query)
        if env.max_tool_tokens is not None:
            output, _ = truncate_to_tokens(output, env.format.tokenizer, env.max_tool_tokens)
        messages.append({"role": "user", "content": format_tool_responses([output])})
        return output

    found = search(task["question"], "Let me search for the question.")
    for title in task["supporting_titles"]:
        if f"(Title: {title})" not in found:
            found += search(title, f"I also need {title}.")
    answer = f"<think>I have what I need.</think>\n<answer>{task['answer']}</answer>"
    return [*messages, {"role": "assistant", "content": answer}]
