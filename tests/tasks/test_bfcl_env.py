"""BfclEnv against bfcl-eval itself (its data, tool conversion, simulated backends and checkers, in its own
venv): policies written from BFCL's possible answers, read here from its files, score 1; changed ones 0."""

from __future__ import annotations

import ast
import glob
import json
from pathlib import Path

import pytest

from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.merge import merge_trajectories
from agent_r1.tasks.bfcl import BfclEnv, BfclError, Worker, bfcl_python, worker
from agent_r1.types import Termination
from tests.rollout.test_agent_loop import ScriptedEngine


def answers(category: str) -> dict[str, list]:
    """BFCL's possible answers, read straight from its data files (not through the worker)."""
    (data,) = glob.glob(str(Path(bfcl_python()).parents[1] / "lib/python3*/site-packages/bfcl_eval/data"))
    with open(f"{data}/possible_answer/BFCL_v4_{category}.json") as f:
        return {row["id"]: row["ground_truth"] for row in map(json.loads, f)}


def call(name: str, arguments: dict) -> str:
    """A hermes tool call, with "." in the name written "_" as BFCL's tool conversion names it."""
    return f'<tool_call>{{"name": "{name.replace(".", "_")}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def first_answer(ground_truth: list[dict]) -> str:
    """One response that BFCL's possible answers accept: each call with the first accepted value of every
    parameter (an optional one, whose accepted values start with "", left out)."""
    calls = []
    for expected in ground_truth:
        ((name, params),) = expected.items()
        calls.append(call(name, {k: v[0] for k, v in params.items() if v[0] != ""}))
    return "".join(calls)


def run(tokenizer, responses, task, max_turns=20):
    loop = AgentEnvLoop(
        ScriptedEngine(tokenizer, responses),
        lambda: BfclEnv(ChatFormat(tokenizer), worker(), max_turns=max_turns),
        SamplingParams(),
    )
    (t,) = loop.run_sync([task])
    return t


@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "parallel_multiple"])
def test_answers_bfcl_accepts_score_one_and_changed_ones_zero(category, tokenizer):
    for id, truth in list(answers(category).items())[:3]:
        task = {"category": category, "id": id}
        good = run(tokenizer, [first_answer(truth)], task)
        assert good.error is None and good.termination == Termination.ANSWERED and good.reward == 1.0, id
        assert good.metrics["tool_calls"] == len(truth)
        ((name, params),) = truth[0].items()
        wrong = {k: v[0] for k, v in params.items() if v[0] != ""} | {"not_a_parameter": 1}
        bad = run(tokenizer, [call(name, wrong) + first_answer(truth[1:])], task)
        assert bad.reward == 0.0 and sum(k.startswith("bfcl_error/") for k in bad.metrics) == 1, id
        assert run(tokenizer, ["I cannot help with that."], task).reward == 0.0  # no call at all


def test_the_prompt_offers_bfcls_functions_as_tools(tokenizer):
    t = run(tokenizer, ["no call"], {"category": "simple_python", "id": "simple_python_1"})
    prompt = tokenizer.decode(t.steps[0].prompt_ids)
    assert '"name": "math_factorial"' in prompt and "Note that the provided function is in Python 3 syntax." in prompt
    assert "Calculate the factorial of 5 using math functions." in prompt  # the item's question


def test_irrelevance_passes_only_without_a_call(tokenizer):
    task = {"category": "irrelevance", "id": "irrelevance_0"}
    assert run(tokenizer, ["None of these functions can answer that."], task).reward == 1.0
    assert run(tokenizer, [call("x", {})], task).reward == 0.0


def multi_turn_script(ground_truth: list[list[str]]) -> list[str]:
    """Per user turn: one response with the turn's ground-truth calls (BFCL's call strings, parsed here
    with Python's ast), then a plain answer that ends the turn."""
    script = []
    for turn in ground_truth:
        if turn:
            calls = [ast.parse(c, mode="eval").body for c in turn]
            script.append(
                "".join(call(c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords}) for c in calls)
            )
        script.append("Done.")
    return script


def test_a_multi_turn_run_that_does_what_the_ground_truth_does_passes(tokenizer):
    id = "multi_turn_base_1"  # every ground-truth call has keyword arguments only
    truth = answers("multi_turn_base")[id]
    t = run(tokenizer, multi_turn_script(truth), {"category": "multi_turn_base", "id": id}, max_turns=40)
    assert t.error is None and t.termination == Termination.ANSWERED and t.reward == 1.0
    assert len(t.steps) == sum(2 if turn else 1 for turn in truth)
    first = t.steps[0].info["tool_results"]  # ls(a=True) ran on BFCL's simulated file system
    assert first[0]["name"] == "ls" and "current_directory_content" in first[0]["output"]
    (row,) = merge_trajectories([t])  # the user's later turns and the backends' results are in one row
    text = tokenizer.decode(row.input_ids)
    assert all(turn[0]["content"] in text for turn in run_turns(id))


def run_turns(id: str) -> list:
    return [turn for turn in worker().request("entry", category="multi_turn_base", id=id)["turns"] if turn]


def test_a_multi_turn_run_that_skips_a_turn_fails_on_the_state_check(tokenizer):
    id = "multi_turn_base_1"
    truth = answers("multi_turn_base")[id]
    script = multi_turn_script(truth)
    t = run(tokenizer, [*script[2:], "Done.", "Done."], {"category": "multi_turn_base", "id": id}, max_turns=40)
    assert t.error is None and t.reward == 0.0 and any(k.startswith("bfcl_error/multi_turn") for k in t.metrics)


def test_episodes_of_the_same_item_have_their_own_backends(tokenizer):
    """Two runs of one item at once: the second's `mkdir` must not see the first's (BFCL keys its
    backends by run)."""
    task = {"category": "multi_turn_base", "id": "multi_turn_base_1"}
    mkdir = call("mkdir", {"dir_name": "fresh"})
    engine = ScriptedEngine(tokenizer, [mkdir, mkdir, "Done.", "Done."])
    loop = AgentEnvLoop(engine, lambda: BfclEnv(ChatFormat(tokenizer), worker(), max_turns=2), SamplingParams())
    trajs = loop.run_sync([task, task])
    outputs = [t.steps[0].info["tool_results"][0]["output"] for t in trajs]
    assert outputs == ["None", "None"]  # neither saw the other's directory ("File exists")
    assert all(t.steps[0].info["tool_errors"] == {} for t in trajs)


def test_a_dead_worker_is_started_again_and_a_bad_request_is_one_error(tokenizer):
    bfcl = worker()
    bfcl.request("items", category="simple_python")
    bfcl.proc.kill()
    bfcl.proc.wait()
    assert "simple_python_0" in bfcl.request("items", category="simple_python")["ids"]
    with pytest.raises(BfclError, match="BFCL check: KeyError"):
        bfcl.request("check", category="simple_python", id="no_such_item", calls=[])
    assert bfcl.request("items", category="parallel")["ids"][0] == "parallel_0"  # it went on


SLOW_WORKER = """
import json, sys, time
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "slow":  # as BFCL's logarithm(..., precision=10**8) does
        time.sleep(600)
    print(json.dumps({"op": request["op"]}), flush=True)
"""


def test_a_request_past_its_deadline_kills_the_worker_and_the_next_request_gets_a_fresh_one(tmp_path):
    import sys
    import time

    script = tmp_path / "worker.py"
    script.write_text(SLOW_WORKER)
    bfcl = Worker(sys.executable, timeout_s=1.0, script=str(script))
    try:
        assert bfcl.request("fast") == {"op": "fast"}
        first = bfcl.proc
        start = time.monotonic()
        with pytest.raises(BfclError, match=r"BFCL slow took over 1 s: its worker was killed"):
            bfcl.request("slow")
        assert time.monotonic() - start < 10 and first.poll() is not None  # not the 600 s the call wanted
        assert bfcl.request("fast") == {"op": "fast"} and bfcl.proc is not first
    finally:
        bfcl.close()
