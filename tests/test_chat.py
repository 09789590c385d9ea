"""`agent-r1 chat`: one tool-using turn in a real pseudo-terminal, and the non-interactive modes."""

from __future__ import annotations

import json
import os
import sys

import pexpect
import pytest

from agent_r1.cli import main
from tests.conftest import TOOL_ANSWER, TOOL_QUESTION


def test_terminal_session_streams_a_tool_using_turn(tool_model_dir):
    env = os.environ | {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    args = ["-m", "agent_r1.cli", "chat", "--model", str(tool_model_dir), "--tools", "calculator"]
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=60, dimensions=(40, 120))
    try:
        child.expect("you ›")
        child.sendline(TOOL_QUESTION)
        child.expect("tool call · calculator")
        child.expect('"expression": "6 \\* 7"')
        child.expect("tool result")
        child.expect("42")
        child.expect("agent ›")
        child.expect(TOOL_ANSWER.replace(".", "\\."))
        child.expect("you ›")
        child.sendline("/tools")
        child.expect("Evaluate an arithmetic expression")  # the description, from the docstring
        child.sendline("/reset")
        child.expect("conversation cleared")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_prompt_mode_prints_only_the_final_answer(tool_model_dir, capsys):
    assert main(["chat", "--model", str(tool_model_dir), "--prompt", TOOL_QUESTION]) == 0
    assert capsys.readouterr().out == TOOL_ANSWER + "\n"


def test_json_mode_prints_the_whole_trajectory(tool_model_dir, capsys):
    assert main(["chat", f"model={tool_model_dir}", "--prompt", TOOL_QUESTION, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    steps = out["trajectory"]["steps"]
    assert [s["info"]["tool_calls"] for s in steps] == [1, 0]
    assert steps[0]["info"]["tool_results"][0]["output"] == "42"
    assert len(steps[0]["response_ids"]) == len(steps[0]["response_logprobs"]) > 0
    assert [m["role"] for m in out["history"]] == ["user", "assistant", "user", "assistant"]


def test_history_is_kept_between_messages(tool_model_dir, tokenizer):
    import asyncio

    from transformers import AutoModelForCausalLM

    from agent_r1.chat import ChatSession
    from agent_r1.engines.cpu.local_engine import LocalEngine
    from agent_r1.engines.protocol import SamplingParams
    from agent_r1.env.prompt_format import ChatFormat
    from agent_r1.tools import calculator

    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    session = ChatSession(
        LocalEngine(model, tokenizer), ChatFormat(tokenizer), {"calculator": calculator}, SamplingParams(64, 0.0)
    )
    asyncio.run(session.send(TOOL_QUESTION))
    traj = asyncio.run(session.send("And again?"))
    first_prompt = tokenizer.decode(traj.steps[0].prompt_ids)
    assert first_prompt.count(TOOL_QUESTION) == 1 and "And again?" in first_prompt and TOOL_ANSWER in first_prompt
    assert len(session.history) == 6
    session.reset()
    assert session.history == []


def test_a_picture_goes_with_the_message_and_stays_in_the_history(tiny_llava, tmp_path):
    import asyncio

    from PIL import Image

    from agent_r1.chat import ChatSession
    from agent_r1.engines.cpu.local_engine import LocalEngine
    from agent_r1.engines.protocol import SamplingParams
    from agent_r1.env.prompt_format import prompt_format_for
    from tests.conftest import picture

    model, processor = tiny_llava
    path = tmp_path / "p.png"
    Image.fromarray(picture(3)).save(path)
    fmt = prompt_format_for(processor)
    session = ChatSession(LocalEngine(model, processor.tokenizer), fmt, {}, SamplingParams(4, 0.0), max_turns=1)
    traj = asyncio.run(session.send("What is it?", images=(str(path),)))
    assert [i.digest for i in traj.steps[0].images] == [fmt.encoder.encode(picture(3)).digest]
    traj = asyncio.run(session.send("And now?"))
    assert len(traj.steps[0].images) == 1 and session.history[0]["content"][0]["image"] == str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["chat", "--tools", "calculator,browser"],
            "unknown tool 'browser'; available tools: calculator, echo",
        ),
        (["chat", "--json"], "--json needs --prompt"),
        (["chat", "--model", "/no/such/model", "--prompt", "hi"], "model not found"),
    ],
)
def test_bad_chat_arguments_give_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_chat_sees_the_tools_and_instructions_of_its_task(tokenizer):
    """--task hotpotqa brings its search and open tools and its instructions, plus the --tools asked for."""
    from agent_r1.chat import ChatConfig, session_prompt
    from agent_r1.tasks import hotpotqa

    tools, instructions, examples, cut = session_prompt(
        ChatConfig(task="hotpotqa", tools=("calculator",)), tokenizer, True
    )
    assert list(tools) == ["search", "open", "calculator"] and examples == []
    assert instructions == hotpotqa.INSTRUCTIONS["search+open"]
    assert cut == hotpotqa.Options().max_tool_tokens  # search results are cut as in training
    assert tools["search"].fn("Tinted Windows band").startswith("Doc 1 (Title: Tinted Windows")
    assert tools["open"].fn("Tinted Windows (band)").startswith("(Title: Tinted Windows (band)) Tinted Windows")
    tools, instructions, _, cut = session_prompt(ChatConfig(), tokenizer, True)  # no task: the calculator alone
    assert list(tools) == ["calculator"] and instructions == "" and cut is None


def test_chat_uses_the_task_recorded_with_a_trained_policy(tmp_path, tokenizer):
    """A policy directory written by training records its task (and options): chat prompts with them."""
    import json

    from agent_r1.chat import ChatConfig, session_prompt
    from agent_r1.tasks import calculator

    task = {"name": "calculator", "ops": [1], "few_shot": True, "format_weight": 0.0, "data": None}
    (tmp_path / "agent_r1.json").write_text(json.dumps({"prompt_format": "chat", "task": task}))
    tools, instructions, examples, _ = session_prompt(ChatConfig(model=str(tmp_path)), tokenizer, True)
    assert list(tools) == ["calculator"] and instructions == calculator.INSTRUCTIONS
    assert examples == calculator.EXAMPLE  # few_shot=True was recorded: the worked example is shown too
    assert (
        session_prompt(ChatConfig(model=str(tmp_path), system="Be brief."), tokenizer, True).instructions == "Be brief."
    )
    task["few_shot"] = False  # recorded options apply when --task names the recorded task too
    (tmp_path / "agent_r1.json").write_text(json.dumps({"prompt_format": "chat", "task": task}))
    assert session_prompt(ChatConfig(model=str(tmp_path), task="calculator"), tokenizer, True).examples == []
