from agent_r1.rewards import answer_format


def test_answer_format():
    assert answer_format("<answer>12</answer>") == 1.0
    assert answer_format("no tag 12") == 0.0
    assert answer_format("<answer>1</answer><answer>2</answer>") == 0.0
    assert answer_format("<tool_call>{bad</tool_call><answer>3</answer>") == 0.0
