from agent_r1.env.tool_calls import (
    ParsedCall,
    ParseError,
    extract_answer,
    format_tool_call,
    format_tool_responses,
    parse_tool_calls,
)


def test_several_calls_in_one_turn():
    text = (
        'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
        '\n<tool_call>\n{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}\n</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ParsedCall("calculator", {"expression": "1+2"}),
        ParsedCall("echo", '{"text": "hi"}'),
    ]


def test_malformed_calls_become_parse_errors():
    cases = {
        "<tool_call>{name: calculator}</tool_call>": "not valid JSON",
        "<tool_call>[1, 2]</tool_call>": "JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "JSON object",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}': "unclosed",
    }
    for text, message in cases.items():
        (err,) = parse_tool_calls(text)
        assert isinstance(err, ParseError) and message in err.message, text


def test_no_call_and_missing_arguments():
    assert parse_tool_calls("The answer is 4.") == []
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ParsedCall("now", {})]


def test_answer_tag_and_response_format():
    assert extract_answer("x <answer> 12 </answer> y <answer>13</answer>") == "13"
    assert extract_answer("no tag") is None
    assert (
        format_tool_responses(["a", "b"])
        == "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
    )


def test_format_tool_call_round_trips_through_the_parser():
    text = format_tool_call("calculator", {"expression": "6 * 7"})
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    assert parse_tool_calls(text) == [ParsedCall("calculator", {"expression": "6 * 7"})]
