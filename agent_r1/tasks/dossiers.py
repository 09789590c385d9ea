"""Dossiers: a long reading task whose useful tool output is several times a small context budget.

The agent is asked for one attribute (a password, a city or a badge number) of two people. Their
records are among `documents` numbered documents of `records` people each, which the agent reads one
at a time with `read(document)`. The first person is in the first three documents, the second in the
last three, so the whole read is 2,100-2,600 tokens for the default 10 documents: at a budget of 1,024
the first answer has left a truncated or elided context by the time the second is found, and an
append-only one has overflowed.
Only what the agent carries forward itself (a summary, a note: `task.context.strategy`, env/context.py)
gets both answers into one prompt. Reward: 1 for both values in order, and each half logged.

Tasks are generated: task k comes from `random.Random(k)`, and its split (train, val or test = held
out) is a fixed hash bucket of its id (agent_r1.data.splits), whatever the seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent_r1.data.splits import Split, split_of
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import extract_answer, format_tool_call, format_tool_responses
from agent_r1.env.tool_env import ToolEnv
from agent_r1.tools import Tool, ToolResult, tool
from agent_r1.types import Message

KIND_KEY = "attribute"  # eval reports accuracy per attribute asked for

FIRST = ("Mira", "Ivo", "Lena", "Otto", "Nadia", "Boris", "Clara", "Felix", "Greta", "Hugo", "Irma", "Jonas",
         "Karla", "Luca", "Maja", "Nils", "Olga", "Pavel", "Rosa", "Sven")  # fmt: skip
LAST = ("Castell", "Renn", "Vogt", "Marek", "Lind", "Sauer", "Brandt", "Kovac", "Moreau", "Ortega", "Petrov",
        "Quist", "Rahn", "Stahl", "Tamm", "Ulrich", "Varga", "Weiss", "Zorn", "Haas")  # fmt: skip
CITIES = ("Lyon", "Porto", "Graz", "Turin", "Ghent", "Bergen", "Split", "Malmo", "Krakow", "Tartu", "Bilbao",
          "Lille", "Basel", "Aarhus", "Brno", "Cork", "Pisa", "Riga", "Nantes", "Varna")  # fmt: skip
WORDS = ("ember", "falcon", "cobalt", "willow", "quartz", "harbor", "lantern", "maple", "orbit", "saffron",
         "thistle", "velvet", "anchor", "birch", "cinder", "dune", "fable", "glacier", "hollow", "juniper")  # fmt: skip
COLOURS = ("red", "blue", "green", "grey", "black", "white", "yellow", "brown")
ATTRIBUTES = ("password", "city", "badge")
MAX_PEOPLE = (len(FIRST) - 2) * len(LAST) + 2  # the names `_names` can give

INSTRUCTIONS = (
    "Answer the question from the documents. Read them one at a time, in order, with the read tool, until "
    "you have found everything the question asks for. Then give the final answer inside <answer></answer>."
)


@dataclass
class Options:
    documents: int = 10
    """documents per task (>= 6): the first person is in the first 3, the second in the last 3"""
    records: int = 8
    """people per document (~25 tokens each)"""
    attributes: tuple[str, ...] = ATTRIBUTES
    """what questions ask for, cycled: password, city, badge"""
    process_reward: bool = False
    """memory strategy: reward each note that keeps a value asked for, Phi = share of the two noted
    (`notes_kept`), weighted by `algo.process_reward_weight`"""

    def __post_init__(self) -> None:
        if self.documents < 6 or not 1 <= self.records <= 20 or self.documents * self.records > MAX_PEOPLE:
            raise ValueError(
                f"task.documents must be >= 6, task.records in 1..20 and documents x records <= {MAX_PEOPLE}, "
                f"got {self.documents}, {self.records}"
            )
        if not self.attributes or any(a not in ATTRIBUTES for a in self.attributes):
            raise ValueError(f"task.attributes must be some of {', '.join(ATTRIBUTES)}, got {self.attributes}")


def make_task(
    k: int, documents: int = 10, records: int = 8, attributes: tuple[str, ...] = ATTRIBUTES
) -> dict[str, Any]:
    """Task k: the documents (a list of texts), the two people asked about, and the answer."""
    rng = random.Random(k)
    asked = rng.sample(FIRST, 2)  # first names no one else in the task has (why: `_names`)
    first, second = rng.randrange(3), documents - 1 - rng.randrange(3)
    where = [first * records + rng.randrange(records), second * records + rng.randrange(records)]
    names = _names(rng, asked, documents * records, where)
    people = [
        {"name": n, "city": rng.choice(CITIES), "password": rng.choice(WORDS), "badge": str(rng.randint(1000, 9999)),
         "colour": rng.choice(COLOURS)}
        for n in names
    ]  # fmt: skip
    docs = [people[d * records : (d + 1) * records] for d in range(documents)]
    a, b = people[where[0]], people[where[1]]
    attribute = attributes[k % len(attributes)]
    what = {"password": "passwords", "city": "home cities", "badge": "badge numbers"}[attribute]
    return {
        "id": f"dossiers-{k}",
        "question": f"What are the {what} of {a['name']} and {b['name']}? There are {documents} documents. "
        f"Answer with the two, {a['name']}'s first, separated by a comma.",
        "documents": [_document(i + 1, d) for i, d in enumerate(docs)],
        "people": [a["name"], b["name"]],
        "found_in": [first + 1, second + 1],
        "values": [a[attribute], b[attribute]],
        "answer": f"{a[attribute]}, {b[attribute]}",
        "attribute": attribute,
    }


def _names(rng: random.Random, asked: list[str], n: int, where: list[int]) -> list[str]:
    """`n` distinct names; the two asked about (first names `asked`) at positions `where`, and no one else
    with either first name. Why: a person's first name then finds their record. With namesakes
    ("Olga Weiss" asked, "Olga Stahl" in the document), SmolLM2-135M after SFT noted the namesake's value
    (docs/log/measurements.md, "Why SFT taught no note"), and the task measured telling names apart, not what the
    context keeps."""
    others = rng.sample([f"{a} {b}" for a in FIRST if a not in asked for b in LAST], n - 2)
    for name, at in zip(asked, where, strict=True):
        others.insert(at, f"{name} {rng.choice(LAST)}")
    return others


def _document(number: int, people: list[dict[str, str]]) -> str:
    lines = [
        f"{p['name']} lives in {p['city']}, drives a {p['colour']} car, has badge {p['badge']} and the password "
        f"{p['password']}."
        for p in people
    ]
    return f"Document {number}:\n" + "\n".join(lines)


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` tasks of a split (generated in id order, so the same for every seed)."""
    out, k = [], 0
    while len(out) < n:
        if split_of(f"dossiers-{k}") == split:
            out.append(make_task(k, options.documents, options.records, options.attributes))
        k += 1
    return out


def reward(task: dict[str, Any], text: str) -> tuple[float, dict[str, float]]:
    """1 when the answer gives both values in order; each half logged (`reward/first`, `reward/second`)."""
    answer = extract_answer(text)
    given = [_norm(x) for x in (answer or "").split(",")]
    first = float(len(given) >= 1 and given[0] == _norm(task["values"][0]))
    second = float(len(given) >= 2 and given[1] == _norm(task["values"][1]))
    correct = float(first and second and len(given) == 2)
    return correct, {"correct": correct, "first": first, "second": second}


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def read_tool(documents: Callable[[], list[str]]) -> Tool:
    """`read(document)` over the documents of the episode's task (`documents()` gives them)."""

    @tool
    def read(document: int) -> str | ToolResult:
        """Read one document.

        Args:
            document: The document's number, from 1.
        """
        texts = documents()
        if not 1 <= document <= len(texts):
            return ToolResult(
                f"Error: no document {document}; the documents are 1 to {len(texts)}.", error="bad_document"
            )
        return texts[document - 1]

    return read


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 12) -> ToolEnv:
    """A ToolEnv whose `read` tool serves the episode's own task."""
    env = ToolEnv({"read": read_tool(lambda: env.task["documents"])}, prompt_format, reward,
                  instructions=INSTRUCTIONS, max_turns=max_turns,
                  potential=notes_kept if options.process_reward else None)  # fmt: skip
    return env


def notes_kept(task: dict[str, Any], results: list[dict[str, Any]]) -> float:
    """Phi: the share of the two values asked for that a note so far keeps, with its person's first name
    (first names are unique within a task: `_names`). A turn that notes a value earns +1/2 (potential-based
    shaping, Ng et al. 1999); a note of the wrong person or a miscopied value earns nothing.
    Why: with the outcome alone, a group whose samples all fail, or all succeed, carries no signal, and
    from the memory SFT most groups were one or the other (docs/log/measurements.md, "RL from a weaker SFT
    start"); the notes are where those episodes differ."""
    notes = [_words(str(r["arguments"].get("text", ""))) for r in results if r["name"] == "note" and not r["error"]]
    asked = [(_words(p)[0], _norm(v)) for p, v in zip(task["people"], task["values"], strict=True)]
    return sum(any(name in n and value in n for n in notes) for name, value in asked) / len(asked)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def demos(options: Options, env: ToolEnv, n: int, seed: int = 0) -> list[list[Message]]:
    """Demonstrations of the first `n` training tasks for the env's context strategy: read in order until
    both are found, then answer; under `memory`, a note of each value in the turn after it was read.
    Under `summarize`, the summaries are written by `summary` when the env asks for one (trainer/sft.py)."""
    memory = env.context_cfg is not None and env.context_cfg.strategy == "memory"
    return [demo(t, memory) for t in tasks(options, "train", n, seed)]


def demo(task: dict[str, Any], memory: bool = False) -> list[Message]:
    """One task solved: read documents 1.. up to the second person's, then answer. With `memory`, the turn
    after each person's document notes the value, and the answer follows the second note.

    Each turn makes one call: a rollout's turn ends at the first `</tool_call>` (the format's stop
    string), so a demonstration turn of two calls is one a policy could never sample, and SFT on it
    taught the note to come second, where it was never reached."""
    messages: list[Message] = [{"role": "user", "content": task["question"]}]

    def turn(name: str, arguments: dict[str, Any], result: str) -> None:
        messages.extend([{"role": "assistant", "content": format_tool_call(name, arguments)},
                         {"role": "user", "content": format_tool_responses([result])}])  # fmt: skip

    for d in range(1, task["found_in"][1] + 1):
        turn("read", {"document": d}, task["documents"][d - 1])
        if memory and d in task["found_in"]:
            i = task["found_in"].index(d)
            turn("note", {"text": _fact(task, i)}, f"Noted ({i + 1} notes).")
    messages.append({"role": "assistant", "content": f"<answer>{task['answer']}</answer>"})
    return messages


def summary(task: dict[str, Any], history: list[Message]) -> str:
    """The summary a demonstration writes when the env asks for one: the values found in the history so
    far (and in the summary before), what is left, and the next action. The next action is stated, not
    left to be inferred: with "Read documents 1 to N." alone, the answer after a summary was a rare
    decision cued only by an absent sentence, and SFT learned to read on past both values (0.0% held
    out, docs/log/measurements.md, "The summarize arm after the same SFT")."""
    shown = "\n".join(str(m.get("content", "")) for m in history if m["role"] != "assistant")
    found = [i for i in range(2) if f"{task['people'][i]} lives" in shown or _fact(task, i) in shown]
    read = re.findall(
        r'"document": (\d+)', "\n".join(str(m.get("content", "")) for m in history if m["role"] == "assistant")
    )
    facts = [_fact(task, i) + "." for i in found]
    left = [f"{task['people'][i]}'s {task['attribute']} is not found yet." for i in range(2) if i not in found]
    last = max((int(x) for x in read), default=0)
    then = "Next: answer." if not left else f"Next: read document {last + 1}."
    return "<summary>" + " ".join([*facts, *left, f"Read documents 1 to {last}.", then]) + "</summary>"


def _fact(task: dict[str, Any], i: int) -> str:
    return f"{task['people'][i]}'s {task['attribute']} is {task['values'][i]}"
