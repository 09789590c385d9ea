"""SQuAD normalisation, EM / F1 / sub-EM and Agent-R1's format + answer score, on hand-worked cases."""

import pytest

from agent_r1.rewards.qa import (
    exact_match,
    f1_score,
    normalize_answer,
    qa_answer_score,
    qa_em_and_episode_format,
    qa_em_and_format,
    qa_format_score,
    sub_exact_match,
)


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("The Beatles!", "beatles"),
        ("  An  apple, a   day ", "apple day"),
        ("Theatre of the Absurd", "theatre of absurd"),  # "the" inside a word stays
        ("U.S.A.", "usa"),
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_exact_and_sub_exact_match():
    assert exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert exact_match("Eiffel Tower in Paris", "Eiffel Tower") == 0.0
    assert sub_exact_match("Eiffel Tower in Paris", "Eiffel Tower") == 1.0
    assert sub_exact_match("Paris", "Eiffel Tower") == 0.0
    assert exact_match("Paris", ["Lyon", "paris"]) == 1.0  # any of several gold answers


def test_f1_by_hand():
    # pred "barack obama president" vs gold "president obama": 2 shared tokens; P = 2/3, R = 2/2
    assert f1_score("Barack Obama, president", "President Obama") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert f1_score("Tulsa", "Tulsa, Oklahoma") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert f1_score("nothing shared", "Tulsa") == 0.0
    assert f1_score("yes", "no") == 0.0 and f1_score("yes it is", "yes") == 0.0 and f1_score("no", "no") == 1.0


def test_format_score_follows_agent_r1():
    call = '<think>find the band</think>\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    answer = "<think>done</think>\n<answer>Tulsa</answer>"
    assert qa_format_score([call, call, answer]) == pytest.approx(0.3)
    assert qa_format_score(["no think <tool_call>{}</tool_call>", answer]) == pytest.approx(0.1)
    assert qa_format_score([call, "<answer>Tulsa</answer>"]) == pytest.approx(0.1)  # last turn lacks the thought
    assert qa_format_score([]) == 0.0


def test_answer_score_and_total():
    assert qa_answer_score("<think>x</think>\n<answer>Tulsa, Oklahoma</answer>", "Tulsa") == 1.0  # sub-EM
    assert qa_answer_score("I think it is Tulsa <answer>Dallas</answer>", "Tulsa") == 0.2  # mentioned, not answered
    assert qa_answer_score("<answer>Dallas</answer>", "Tulsa") == 0.0
    call = "<think>a</think>\n<tool_call>{}</tool_call>"
    six_calls = [call] * 6 + ["<think>b</think>\n<answer>Tulsa</answer>"]
    assert qa_em_and_format(six_calls, "Tulsa") == pytest.approx(0.5 + 1.0)  # format capped at 0.5
    assert qa_em_and_format([call, "<think>b</think>\n<answer>Dallas</answer>"], "Tulsa") == pytest.approx(0.2)


def test_episode_format_is_paid_once_and_only_to_an_episode_that_answered():
    call = "<think>a</think>\n<tool_call>{}</tool_call>"
    right, wrong = "<think>b</think>\n<answer>Tulsa</answer>", "<think>b</think>\n<answer>Dallas</answer>"
    assert qa_em_and_episode_format([call, right], "Tulsa") == pytest.approx(1.0 + 0.2)
    # more calls earn nothing more (the per-call term would pay 0.1 each, up to 0.5)
    assert qa_em_and_episode_format([call] * 5 + [wrong], "Tulsa") == pytest.approx(0.2)
    assert qa_em_and_format([call] * 5 + [wrong], "Tulsa") == pytest.approx(0.5)
    # cut off at the turn cap: no answer, no format pay (the per-call term still pays the calls)
    assert qa_em_and_episode_format([call] * 4, "Tulsa") == 0.0
    assert qa_em_and_format([call] * 4, "Tulsa") == pytest.approx(0.3)
    # one malformed turn anywhere loses it; the answer term stands
    assert qa_em_and_episode_format(["<tool_call>{}</tool_call>", right], "Tulsa") == pytest.approx(1.0)
    assert qa_em_and_episode_format([right], "Tulsa", bonus=0.5) == pytest.approx(1.5)
    assert qa_em_and_episode_format([], "Tulsa") == 0.0
