"""HotpotQA with search tools: multi-hop questions answered after searching a Wikipedia-paragraph corpus.

Two tool sets (`task.tools`): `search+open` (default), ReAct's Wikipedia tools: `search` shows titles and
the first words of the best matches, `open(title)` the whole paragraph, so the agent coordinates two
tools; `search`, Search-R1's single tool that shows the top passages whole.

Data: the bundled agent_r1/data/files/hotpotqa/{train,dev}.jsonl (HotpotQA distractor, Hugging Face layout, CC BY-SA
4.0); train.jsonl is the training split, dev.jsonl the held-out one. The retrieval corpus is every
context paragraph of both files, pooled and de-duplicated by title (5,912 passages). Reward: Agent-R1's
`qa_em_and_format` (min(format, 0.5) + answer; docs/algorithms.md), with EM, F1, sub-EM and format logged.
The search index is built (or loaded from its disk cache) lazily, the first time an env needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent_r1.data.bundled import bundled
from agent_r1.data.jsonl import load_tasks
from agent_r1.data.splits import Split, split_of
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import extract_answer, format_tool_call, format_tool_responses
from agent_r1.env.tool_env import ToolEnv, truncate_to_tokens
from agent_r1.retrieval import Passage, Retriever, load_retriever, open_tool, search_tool
from agent_r1.retrieval.server import RemoteRetriever
from agent_r1.rewards.qa import (
    EPISODE_FORMAT_BONUS,
    exact_match,
    f1_score,
    qa_em_and_episode_format,
    qa_em_and_format,
    qa_format_score,
    qa_well_formed,
    sub_exact_match,
)
from agent_r1.types import Message

KIND_KEY = "type"  # eval reports accuracy per question type (bridge, comparison)


@dataclass
class Options:
    data: str | None = None
    """HotpotQA-layout jsonl used whole as the tasks (its paragraphs join the corpus); None = the bundled splits"""
    retriever: str = "bm25"
    """search index, bm25 or dense, or the URL of an `agent-r1 retrieval-server`"""
    max_tool_tokens: int = 256
    """each tool response is cut to this many tokens"""
    tools: Literal["search+open", "search"] = "search+open"
    """search+open: search shows titles and snippets, open(title) a paragraph; search: whole passages"""
    snippet_words: int = 12
    """search+open: words of each search result's text shown after its title"""
    process_reward: bool = False
    """reward each turn for the supporting paragraphs it read: Phi = share of them read so far"""
    call_error_reward: float = 0.0
    """process reward per call the model got wrong (bad arguments, unknown tool, malformed); negative
    takes away the format reward's pay for a call that did nothing (docs/search.md)"""
    format_reward: Literal["per_call", "episode"] = "per_call"
    """per_call: Agent-R1's 0.1 per well-formed turn (up to 0.5); episode: 0.2 once for a
    well-formed episode that answered, which calling more cannot raise (docs/search.md)"""
    gold_context: bool = False
    """an oracle for diagnosis: show the supporting paragraphs with the question (measures reading, not search)"""

    def __post_init__(self) -> None:
        if self.max_tool_tokens < 1:
            raise ValueError(f"task.max_tool_tokens must be >= 1, got {self.max_tool_tokens}")
        if self.tools not in ("search+open", "search"):
            raise ValueError(f"task.tools must be search+open or search, got {self.tools!r}")
        if self.format_reward not in ("per_call", "episode"):
            raise ValueError(f"task.format_reward must be per_call or episode, got {self.format_reward!r}")
        if self.snippet_words < 1:
            raise ValueError(f"task.snippet_words must be >= 1, got {self.snippet_words}")
        if self.retriever not in ("bm25", "dense") and not self.retriever.startswith(("http://", "https://")):
            raise ValueError(f"task.retriever must be bm25, dense or a retrieval-server URL, got {self.retriever!r}")


INSTRUCTIONS = {
    "search": (
        "Answer the question. Search for the facts you need, one search per turn, as many times as needed. "
        "In every turn first think briefly inside <think></think>, then either call the search tool or give "
        "the final short answer inside <answer></answer>."
    ),
    "search+open": (
        "Answer the question. Search for pages, then open the pages you need by their title, one tool call "
        "per turn, as many times as needed. In every turn first think briefly inside <think></think>, then "
        "either call a tool or give the final short answer inside <answer></answer>."
    ),
}


def load(path: str | Path | None = None, split: Split = "train", n: int | None = None) -> list[dict[str, Any]]:
    """Tasks of one split: question, answer, type, and the titles of the supporting paragraphs.

    test is HotpotQA's dev file; val and train are the fixed hash buckets of its train file (a file
    given as `path` is used whole)."""
    bucketed = path is None and split != "test"  # val and train share the bundled train file
    path = Path(path) if path else bundled("hotpotqa/dev.jsonl" if split == "test" else "hotpotqa/train.jsonl")
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
    paths = paths or _corpus_paths()
    seen: dict[str, Passage] = {}
    for path in paths:
        for row in load_tasks(path):
            context = row.get("context") or {}
            for title, sentences in zip(context.get("title", []), context.get("sentences", []), strict=True):
                if title not in seen:
                    seen[title] = Passage(title, "".join(sentences).strip())
    return list(seen.values())


def retriever_for(kind: str = "bm25", extra: Sequence[str | Path] = ()) -> Retriever:
    """`bm25` or `dense` over the corpus (the bundled files + `extra` files), or the URL of
    an `agent-r1 retrieval-server` that many rollout workers share."""
    if kind.startswith(("http://", "https://")):
        return RemoteRetriever(kind)
    return _cached_retriever(kind, _corpus_paths(extra))


def _corpus_paths(extra: Sequence[str | Path] = ()) -> tuple[str, ...]:
    """The bundled files, then `extra` files."""
    return tuple(str(bundled(f"hotpotqa/{name}.jsonl")) for name in ("train", "dev")) + tuple(str(p) for p in extra)


@functools.cache
def _cached_retriever(kind: str, paths: tuple[str, ...]) -> Retriever:
    return load_retriever(_pages(paths), kind)


def reward(
    task: dict[str, Any], responses: list[str], format_reward: str = "per_call"
) -> tuple[float, dict[str, float]]:
    """Agent-R1's qa_em_and_format over the episode's responses (or, with format_reward=episode,
    the format paid once), with EM / F1 / sub-EM of the answer and the format term logged."""
    answer = extract_answer(responses[-1]) if responses else None
    scored = {"em": exact_match, "f1": f1_score, "sub_em": sub_exact_match}
    parts = {name: fn(answer, task["answer"]) if answer is not None else 0.0 for name, fn in scored.items()}
    if format_reward == "episode":
        total, fmt = (
            qa_em_and_episode_format(responses, task["answer"]),
            EPISODE_FORMAT_BONUS * qa_well_formed(responses),
        )
    else:
        total, fmt = qa_em_and_format(responses, task["answer"]), qa_format_score(responses)
    return total, parts | {"correct": parts["em"], "format": fmt}


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    rows = load(options.data, split=split, n=n)
    if options.gold_context:
        text = {p.title: p.text for p in pages(options)}
        for t in rows:
            gold = "\n".join(f"(Title: {title}) {text[title]}" for title in t["supporting_titles"] if title in text)
            t["messages"] = [{"role": "user", "content": f"{gold}\n\nQuestion: {t['question']}"}]
    return rows


def retriever(options: Options) -> Retriever:
    """The index the search tool uses (one per process, cached)."""
    return retriever_for(options.retriever, extra=[options.data] if options.data else [])


def service(options: Options) -> Any:
    """What Ray's rollout workers share instead of building one each (`cluster.retrieval_actor`): the
    search index, behind `agent-r1 retrieval-server`'s HTTP API."""
    from agent_r1.retrieval.server import create_app

    return create_app(retriever(options), options.retriever)


def using_service(options: Options, url: str) -> Options:
    """The options of envs that query the shared index at `url`."""
    return dataclasses.replace(options, retriever=url)


@functools.cache
def _pages(paths: tuple[str, ...]) -> list[Passage]:
    return corpus(paths)


def pages(options: Options) -> list[Passage]:
    """The paragraphs `open` reads: the corpus the index was built on (read locally, also when the
    index is a retrieval server's)."""
    return _pages(_corpus_paths([options.data] if options.data else []))


def support_read(task: dict[str, Any], results: list[dict[str, Any]], whole_search: bool = False) -> float:
    """Phi: the share of the task's supporting paragraphs that the episode's tool results showed whole
    (an `open` of the page; with the single `search` tool, a search hit). 0 for a task without them."""
    support = task.get("supporting_titles") or []
    if not support:
        return 0.0
    shown = [r["output"] for r in results if not r["error"] and (r["name"] == "open" or whole_search)]
    return sum(any(f"(Title: {t})" in out for out in shown) for t in support) / len(support)


def make_env(
    options: Options,
    prompt_format: PromptFormat,
    max_turns: int = 4,
    index: Retriever | None = None,
    corpus_pages: Sequence[Passage] | None = None,
) -> ToolEnv:
    """A ToolEnv with `search` (over `index`, default the options' retriever) and, with
    tools=search+open, `open` (over `corpus_pages`, default the task's corpus); each tool response is
    cut to `options.max_tool_tokens` tokens. With `process_reward`, a turn earns the rise of
    `support_read` it caused (potential-based shaping, Ng et al. 1999); with `call_error_reward`, each
    call the model got wrong earns it."""
    index = index or retriever(options)
    whole = options.tools == "search"
    tools = {"search": search_tool(index)} if whole else {
        "search": search_tool(index, snippet_words=options.snippet_words, k=5),
        "open": open_tool(corpus_pages if corpus_pages is not None else pages(options)),
    }  # fmt: skip
    return ToolEnv(
        tools,
        prompt_format,
        functools.partial(reward, format_reward=options.format_reward),
        instructions=INSTRUCTIONS[options.tools],
        max_turns=max_turns,
        max_tool_tokens=options.max_tool_tokens,
        reward_on="episode",
        potential=functools.partial(support_read, whole_search=whole) if options.process_reward else None,
        call_error_reward=options.call_error_reward,
    )


def demos(options: Options, env: ToolEnv, n: int, seed: int = 0) -> list[list[Message]]:
    """Search demonstrations of the first `n` training questions (tool responses from `env`'s index);
    with `gold_context`, answers read from the supporting paragraphs in the prompt, without a tool."""
    return [demo(t, env) for t in tasks(options, "train", n)]


def demo(task: dict[str, Any], env: ToolEnv) -> list[Message]:
    """A cold-start demonstration: search the question; then, with `open`, open each supporting page
    (searching its title first when no result so far named it); with `search` alone, search each
    supporting paragraph it did not find by its title; then answer.

    Searching the question first is what a small model can learn to do on any question; the titles
    of the missing paragraphs are the second hop (they appear in the first results as bridge
    entities). Tool responses come from `env`'s own tools and token cut, so SFT shows exactly what a
    rollout would see.

    A task with its own `messages` (the `gold_context` oracle: the supporting paragraphs, then the
    question) is answered at once, quoting where the paragraphs state the answer: a reader trained on
    these measures reading apart from searching."""
    if "messages" in task:
        return [*task["messages"], final_answer(task, task["messages"][-1]["content"])]
    messages: list[Message] = [{"role": "user", "content": task["question"]}]

    def call(name: str, args: dict[str, str], thought: str) -> str:
        content = f"<think>{thought}</think>\n" + format_tool_call(name, args)
        messages.append({"role": "assistant", "content": content})
        output = env.tools[name].fn(**args)
        output = getattr(output, "output", output)  # a ToolResult (an unknown title) shows its text
        if env.max_tool_tokens is not None:
            output, _ = truncate_to_tokens(output, env.format.tokenizer, env.max_tool_tokens)
        messages.append({"role": "user", "content": format_tool_responses([output])})
        return output

    found = call("search", {"query": task["question"]}, "Let me search for the question.")
    for title in task["supporting_titles"]:
        if "open" not in env.tools:
            if f"(Title: {title})" not in found:
                found += "\n" + call("search", {"query": title}, f"I also need {title}.")
            continue
        if f"(Title: {title})" not in found and title not in found:
            found += "\n" + call("search", {"query": title}, f"I need {title}.")
        found += "\n" + call("open", {"title": title}, f"{title} may have the answer.")
    return [*messages, final_answer(task, found)]


def final_answer(task: dict[str, Any], found: str) -> Message:
    """The demonstration's last turn: quote where `found` states the answer, then give it."""
    thought = evidence(found, task["answer"]) or "I have what I need."
    return {"role": "assistant", "content": f"<think>{thought}</think>\n<answer>{task['answer']}</answer>"}


def evidence(text: str, answer: str, words: int = 12) -> str | None:
    """Where the retrieved `text` states the answer: up to `words` words either side of its first
    mention in an opened paragraph (else in any result), None if no result contains it. The
    demonstration's last thought quotes it, so a small model learns to find the answer before giving it."""
    if answer.lower() in ("yes", "no"):
        return None
    lines = text.splitlines()
    for line in [x for x in lines if x.startswith("(Title:")] + lines:
        body = re.sub(r"^(Doc \d+ )?\(Title: [^)]*\)\s*", "", line)
        at = body.lower().find(answer.lower())
        if at >= 0:
            end = at + len(answer)
            starts = [m.start() for m in re.finditer(r"\S+", body[:at])][-words:]
            ends = [end + m.end() for m in re.finditer(r"\S+", body[end:])][:words]
            return body[starts[0] if starts else at : ends[-1] if ends else end].removesuffix(" ...[truncated]")
    return None
