"""Question-answering rewards: SQuAD-normalised EM, F1 and sub-EM, and Agent-R1's format + answer score.

Normalisation is the official SQuAD / HotpotQA one (Rajpurkar et al. 2016, arXiv 1606.05250): lower
case, drop punctuation, drop the articles a/an/the, collapse whitespace. docs/search.md ("Rewards")
gives the exact formula of `qa_em_and_format`.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

from agent_r1.env.tool_calls import extract_answer

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
# Agent-R1's well-formed turns: a thought, then exactly one tool call (intermediate) or the answer (last)
_CALL_TURN = re.compile(r"^<think>(.*?)</think>\n<tool_call>(.*?)</tool_call>$", re.DOTALL)
_ANSWER_TURN = re.compile(r"^<think>(.*?)</think>\n<answer>(.*?)</answer>$", re.DOTALL)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(gold: str | Sequence[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else list(gold)


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(gold)))


def sub_exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 when a normalised gold answer is a substring of the normalised prediction (Search-R1's sub-EM)."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) in pred for g in _golds(gold)))


def f1_score(prediction: str, gold: str | Sequence[str]) -> float:
    """Token-overlap F1 of the normalised strings, best over gold answers. As in the HotpotQA
    evaluation script, yes/no/noanswer only count when both sides are exactly that word."""
    best = 0.0
    pred = normalize_answer(prediction)
    for g in _golds(gold):
        ref = normalize_answer(g)
        special = {"yes", "no", "noanswer"}
        if (pred in special or ref in special) and pred != ref:
            continue
        common = Counter(pred.split()) & Counter(ref.split())
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(pred.split()), same / len(ref.split())
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def qa_format_score(responses: Sequence[str]) -> float:
    """Agent-R1's format term: +0.1 per intermediate turn that is exactly `<think>…</think>\\n<tool_call>…
    </tool_call>`, +0.1 when the last turn is exactly `<think>…</think>\\n<answer>…</answer>`."""
    if not responses:
        return 0.0
    score = 0.1 * sum(bool(_CALL_TURN.match(r.strip())) for r in responses[:-1])
    return score + 0.1 * bool(_ANSWER_TURN.match(responses[-1].strip()))


def qa_answer_score(final_response: str, gold: str | Sequence[str]) -> float:
    """Agent-R1's answer term: 1.0 when the `<answer>` content sub-exactly matches a gold answer,
    else 0.2 when a gold answer appears anywhere in the last turn, else 0."""
    answer = extract_answer(final_response)
    if answer is not None and sub_exact_match(answer, gold):
        return 1.0
    return 0.2 if sub_exact_match(final_response, gold) else 0.0


def qa_em_and_format(responses: Sequence[str], gold: str | Sequence[str]) -> float:
    """min(format, 0.5) + answer: the semantics of Agent-R1's `qa_em_and_format` reward."""
    if not responses:
        return 0.0
    return min(qa_format_score(responses), 0.5) + qa_answer_score(responses[-1], gold)


def qa_well_formed(responses: Sequence[str]) -> bool:
    """Every turn well formed, and the episode ended with an answer: a thought and one tool call per
    intermediate turn, a thought and the answer in the last."""
    if not responses:
        return False
    calls = all(_CALL_TURN.match(r.strip()) for r in responses[:-1])
    return calls and bool(_ANSWER_TURN.match(responses[-1].strip()))


EPISODE_FORMAT_BONUS = 0.2


def qa_em_and_episode_format(
    responses: Sequence[str], gold: str | Sequence[str], bonus: float = EPISODE_FORMAT_BONUS
) -> float:
    """answer + `bonus` once when the whole episode is well formed (`qa_well_formed`).

    The Search-R1 authors' format reward (Jin et al. 2025, "An Empirical Study on RL for
    Reasoning-Search Interleaved LLM Agents", arXiv 2505.15117) pays the format once per episode;
    Agent-R1's per-call term pays each well-formed call, so a policy can earn it by calling more
    instead of answering (docs/search.md, "A format reward paid once"). Paid once, and only
    to an episode that answered, more calls earn nothing and running into the turn cap loses it."""
    return qa_answer_score(responses[-1], gold) + bonus * qa_well_formed(responses) if responses else 0.0
