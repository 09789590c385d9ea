from agent_r1.env.prompt_format import ChatFormat, TextFormat


def test_chat_continuation_reproduces_the_template_text(tokenizer):
    fmt = ChatFormat(tokenizer)
    system = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 6*7?"}]
    tool_turn = [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}]
    response = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    incremental = fmt.initial(system) + tokenizer.encode(response) + fmt.continuation(tool_turn, after_eos=False)
    full = tokenizer.apply_chat_template(
        [*system, {"role": "assistant", "content": response}, *tool_turn],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tokenizer.decode(incremental) == full


def test_chat_continuation_after_eos_does_not_repeat_the_end_of_turn(tokenizer):
    fmt = ChatFormat(tokenizer)
    turn = [{"role": "user", "content": "next"}]
    after_stop = tokenizer.decode(fmt.continuation(turn, after_eos=False))
    after_eos = tokenizer.decode(fmt.continuation(turn, after_eos=True))
    assert after_stop == tokenizer.eos_token + after_eos
    assert after_eos.startswith("\n<|im_start|>user\nnext")


def test_text_format_for_base_models(tokenizer):
    fmt = TextFormat(tokenizer)
    msgs = [{"role": "system", "content": "Tools here."}, {"role": "user", "content": "Q1"}]
    text = tokenizer.decode(fmt.initial(msgs), skip_special_tokens=True)
    assert text == "Tools here.\n\nUser: Q1\nAssistant:"
    cont = tokenizer.decode(fmt.continuation([{"role": "user", "content": "R"}], after_eos=False))
    assert cont == "\nUser: R\nAssistant:"
    assert fmt.stop == ("\nUser:",)
