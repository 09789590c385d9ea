from agent_r1.rollout.text_stream import TextStream, visible_prefix


def test_deltas_concatenate_to_the_full_decode_and_hide_eos(tokenizer):
    text = "Déjà vu 🤖 costs 12 € — <tool_call>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, hidden_ids=[tokenizer.eos_token_id])
    deltas = [stream.push(t) for t in [*ids, tokenizer.eos_token_id]]
    assert "".join(deltas) == tokenizer.decode(ids) == text == stream.text
    assert all("\ufffd" not in d for d in deltas) and deltas[-1] == ""
    assert len(ids) > len([d for d in deltas if d])  # the emoji's byte pieces were held back, then joined


def test_visible_prefix_cuts_at_markers_and_holds_back_partial_ones():
    markers = ("<tool_call>", "\nUser:")
    assert visible_prefix("Let me see <tool_", markers, final=False) == "Let me see "
    assert visible_prefix("Let me see <tool_", markers, final=True) == "Let me see <tool_"
    assert visible_prefix('Sure.<tool_call>{"name": "x"}', markers, final=False) == "Sure."
    assert visible_prefix("a < b", markers, final=False) == "a < b"
    assert visible_prefix("42\nUser: next", markers, final=True) == "42"
    assert visible_prefix("42\nUs", markers, final=False) == "42"
    assert visible_prefix("plain", (), final=False) == "plain"


def test_markers_hold_text_back_until_the_end(tokenizer):
    stream = TextStream(tokenizer, markers=["<tool_call>"])
    text = 'Sure. <tool_call>{"name": "calculator"}'
    shown = "".join(stream.push(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert shown == "Sure. " and stream.finish() == ""
    assert stream.finish(final=text) == text[len("Sure. ") :]  # not a valid call after all: show the rest
