from agent_r1.rewards import last_number, numeric_match


def test_last_number():
    assert last_number("first 3, then 4,500.25 apples") == 4500.25
    assert last_number("it is -12") == -12.0
    assert last_number("no digits") is None


def test_numeric_match():
    assert numeric_match("The answer is 42.", 42) == 1.0
    assert numeric_match("42.0000000001", "42") == 1.0
    assert numeric_match("41", 42) == 0.0
    assert numeric_match("", 0) == 0.0
