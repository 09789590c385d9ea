"""Rewards for live traffic: the implicit rule, how a session's rewards become a trajectory's, the judge."""

from __future__ import annotations

import time

import pytest
from fastapi import FastAPI

from agent_r1.online.rewards import Judge, JudgeConfig, JudgeError, answer_reward, implicit_signal, session_return
from tests.conftest import serving


@pytest.mark.parametrize(
    ("next_text", "expected"),
    [
        ("No, that's wrong.", 0.0),
        ("wrong", 0.0),
        ("Try again please", 0.0),
        ("That is not right", 0.0),
        ("What is 17 * 3 ?", 0.0),  # the same question again (punctuation aside): a re-ask
        ("Thanks!", 1.0),
        ("Great. Now what is 5 + 5?", 1.0),
        ("Nothing else matters", 1.0),  # "no" only as a word of its own
        (None, None),  # the session's last answer
    ],
)
def test_the_implicit_rule(next_text, expected):
    assert implicit_signal("What is 17 * 3?", "51", next_text) == expected


def test_an_answers_reward_comes_from_the_first_source_that_scored_it():
    rewards = [
        {"source": "implicit", "score": 1.0},
        {"source": "judge", "score": None},  # a failed judge call
        {"source": "judge", "score": 0.3},
        {"source": "explicit", "score": 0.2},
        {"source": "explicit", "score": 0.9},  # the user changed their mind: the latest counts
    ]
    assert answer_reward(rewards) == (0.9, "explicit")
    assert answer_reward(rewards[:3]) == (0.3, "judge")
    assert answer_reward(rewards[:2]) == (1.0, "implicit")
    assert answer_reward([{"source": "judge", "score": None}]) is None


def test_a_sessions_return():
    # the session's own score is the outcome; every answer's reward stays a process reward
    assert session_return([0.0, 1.0], [0.5, None, 0.2]) == (1.0, [0.5, None, 0.2])
    # without one, the last scored answer's reward is the outcome, and not also a process reward
    assert session_return([], [0.5, 1.0, None]) == (1.0, [0.5, None, None])
    assert session_return([], [None, None]) is None


def test_a_python_judge_and_its_failures():
    judge = Judge(JudgeConfig(function="tests.online.test_rewards:length_judge"))
    assert judge("q", "four") == 0.4
    with pytest.raises(JudgeError, match="not in"):
        judge("q", "x" * 20)  # 2.0: out of range
    with pytest.raises(JudgeError, match="ZeroDivisionError"):
        judge("q", "")


def length_judge(user_text: str, answer: str) -> float:
    return len(answer) / 10 if answer else 1 / 0


def judge_server(delay: float, reply: str) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    def complete(body: dict) -> dict:
        time.sleep(delay)
        assert body["messages"][0]["role"] == "system" and "Answer:\n42" in body["messages"][1]["content"]
        return {"choices": [{"message": {"role": "assistant", "content": reply}}]}

    return app


def test_an_openai_compatible_judge_grades_out_of_ten():
    with serving(judge_server(0.0, "8")) as url:
        judge = Judge(JudgeConfig(url=f"{url}/v1", model="grader"))
        assert judge("What is 6*7?", "42") == 0.8
        judge.close()


def test_a_slow_down_or_confused_judge_is_a_judge_error_not_a_hang():
    with serving(judge_server(2.0, "8")) as url:
        judge = Judge(JudgeConfig(url=f"{url}/v1", model="grader", timeout_s=0.3))
        start = time.perf_counter()
        with pytest.raises(JudgeError, match="Timeout"):
            judge("What is 6*7?", "42")
        assert time.perf_counter() - start < 1.5
    with serving(judge_server(0.0, "I refuse")) as url, pytest.raises(JudgeError, match="not a grade"):
        Judge(JudgeConfig(url=f"{url}/v1", model="grader"))("What is 6*7?", "42")
    down = Judge(JudgeConfig(url="http://127.0.0.1:9/v1", model="grader", timeout_s=1))
    with pytest.raises(JudgeError, match="ConnectError"):
        down("What is 6*7?", "42")


def test_judge_config_is_checked():
    with pytest.raises(ValueError, match="not both"):
        JudgeConfig(function="a:b", url="http://x")
    with pytest.raises(ValueError, match=r"judge\.model"):
        JudgeConfig(url="http://x")
