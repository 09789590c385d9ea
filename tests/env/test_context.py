"""Managed contexts (env/context.py): every prompt within the budget, what each strategy keeps and drops,
the summary and note steps, bad input, and rows whose size stays bounded as turns grow."""

import json
import pickle

import pytest

from agent_r1.config import ConfigError
from agent_r1.env.context import SUMMARY_REQUEST, ContextConfig
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.env.tool_calls import extract_answer
from agent_r1.env.tool_env import ToolEnv
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.task import TaskSpec
from agent_r1.tools import tool
from agent_r1.types import Action, Step, Termination, Trajectory

QUESTION = "Echo the words of each fruit, then answer with the first fruit."


def act(tokenizer, text):
    ids = tokenizer.encode(text)
    return Action(ids, [-1.0] * len(ids), text, "stop")


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def fruit(i):
    """A tool output of ~60 tokens whose first word tells which turn made it."""
    return f"fruit{i} " + " ".join(f"w{i}x{k}" for k in range(20))


@tool
def read(page: int) -> str:
    """Read a page.

    Args:
        page: which page
    """
    return fruit(page)


async def episode(tokenizer, cfg, policy, max_turns=40):
    """Run a policy through a managed env with the `read` tool: `policy` is a list of response texts, or
    a function of the prompt's text. Returns the env, the prompts it showed, the step results and the
    steps as the rollout would record them."""
    env = ToolEnv({"read": read}, ChatFormat(tokenizer), lambda t, x: float(extract_answer(x) == "fruit0"),
                  max_turns=max_turns).manage(cfg)  # fmt: skip
    obs = await env.reset({"question": QUESTION})
    prompts, results, steps = [], [], []
    for i in range(len(policy) if isinstance(policy, list) else 3 * max_turns):
        prompts.append(list(obs.token_ids))
        text = policy[i] if isinstance(policy, list) else policy(tokenizer.decode(obs.token_ids))
        a = act(tokenizer, text)
        result = await env.step(a)
        results.append(result)
        steps.append(Step(list(obs.token_ids), a.token_ids, a.logprobs, result.reward, result.info, text, i))
        if result.done:
            break
        obs = result.observation
    return env, prompts, results, steps


def echoes(n):
    return [call("read", page=i) for i in range(n)]


def reader(pages, summary):
    """Reads pages 0..pages-1, answers the summary request with `summary`, then answers fruit0."""
    read_so_far = []

    def policy(prompt):
        if prompt.rstrip().endswith(SUMMARY_REQUEST + "<|im_end|>\n<|im_start|>assistant"):
            return summary
        if len(read_so_far) < pages:
            read_so_far.append(len(read_so_far))
            return call("read", page=read_so_far[-1])
        return "<answer>fruit0</answer>"

    return policy


@pytest.mark.parametrize("strategy", ["truncate", "elide", "memory"])
async def test_every_prompt_fits_the_budget_and_the_newest_output_is_shown(tokenizer, strategy):
    cfg = ContextConfig(strategy=strategy, budget=700)
    env, prompts, results, _ = await episode(tokenizer, cfg, echoes(12))
    assert all(len(p) <= 700 for p in prompts)
    last = tokenizer.decode(results[-1].observation.token_ids)
    assert fruit(11) in last and QUESTION in last
    assert fruit(0) not in last  # the first output is gone
    assert env.managed.dropped > 0 or env.managed.elided > 0


async def test_a_rewrite_takes_from_older_turns_and_leaves_the_newest_whole_within_the_budget(tokenizer):
    """keep=0.3 asks for less than the head and one turn: the older turns go, the newest output stays
    whole because the prompt is within the budget."""
    _, _, results, _ = await episode(tokenizer, ContextConfig(strategy="elide", budget=700, keep=0.3), echoes(10))
    for i, r in enumerate(results):
        assert fruit(i) in tokenizer.decode(r.observation.token_ids)


async def test_truncate_drops_whole_turns_and_says_so(tokenizer):
    env, _, results, _ = await episode(tokenizer, ContextConfig(strategy="truncate", budget=700), echoes(12))
    last = tokenizer.decode(results[-1].observation.token_ids)
    assert f"[{env.managed.dropped} earlier turns are not shown" in last
    assert "fruit0" not in last  # neither its call nor its output
    assert env.managed.elided == 0


async def test_elide_keeps_the_models_calls_and_drops_only_their_outputs(tokenizer):
    env, _, results, _ = await episode(tokenizer, ContextConfig(strategy="elide", budget=900), echoes(8))
    last = tokenizer.decode(results[-1].observation.token_ids)
    assert '"arguments": {"page": 0}' in last  # the first call, as the model wrote it
    assert "<tool_response>\nfruit0" not in last and "[tool output elided:" in last
    assert env.managed.dropped == 0 and env.managed.elided >= 1


async def test_rewrites_are_occasional_so_turns_between_them_share_a_row(tokenizer):
    """keep=0.5: a rewrite frees half the budget, so several turns append before the next one; the
    episode's rows are each at most one budget + one response long (linear compute in turns)."""
    cfg = ContextConfig(strategy="elide", budget=700, keep=0.5)
    _, _, results, steps = await episode(tokenizer, cfg, echoes(20))
    rewrites = sum(r.info["metrics"]["context/rewrites"] for r in results)
    rows = merge_trajectory(Trajectory(task={}, traj_id="t", group_id="g", steps=steps))
    assert 2 <= rewrites <= 10 and len(rows) == rewrites + 1
    longest_response = max(len(s.response_ids) for s in steps)
    assert all(len(r.input_ids) <= 700 + longest_response for r in rows)
    assert sum(r.loss_mask.count(1) for r in rows) == sum(len(s.response_ids) for s in steps)


async def test_summarize_asks_for_a_summary_and_restarts_from_it(tokenizer):
    cfg = ContextConfig(strategy="summarize", budget=700)
    policy = reader(12, "<summary>fruit0 came first; fruit1..fruit11 seen.</summary>")
    env, prompts, results, _ = await episode(tokenizer, cfg, policy)
    asked = [i + 1 for i, p in enumerate(prompts) if SUMMARY_REQUEST in tokenizer.decode(p)]
    assert asked and all(len(prompts[i - 1]) <= 700 for i in asked)  # the summary steps' prompts fit too
    summary_step = results[asked[0] - 1]
    after = tokenizer.decode(summary_step.observation.token_ids)
    assert "Summary of your work so far:\nfruit0 came first; fruit1..fruit11 seen." in after
    assert "<tool_response>\n" not in after and QUESTION in after
    assert summary_step.reward is None and summary_step.info["metrics"]["context/summaries"] == 1
    assert summary_step.observation.state != results[asked[0] - 2].observation.state  # GiGPO: a new state
    assert env.turn == len(results) - len(asked)  # a summary step is not a turn of the task
    assert results[-1].done and results[-1].reward == 1.0


@pytest.mark.parametrize(
    ("summary", "problem", "shown"),
    [
        ("", "empty", "(no summary)"),
        ("<summary>   </summary>", "empty", "(no summary)"),
        ("<summary>" + "blah " * 400 + "</summary>", "too_long", "blah blah"),
        ("I will look again. " + call("read", page=1), "tool_call", "I will look again."),
    ],
)
async def test_a_bad_summary_is_kept_cut_and_penalised(tokenizer, summary, problem, shown):
    cfg = ContextConfig(strategy="summarize", budget=500, summary_tokens=64, summary_penalty=0.2)
    env, prompts, results, _ = await episode(tokenizer, cfg, reader(8, summary))
    k = next(i for i, p in enumerate(prompts) if SUMMARY_REQUEST in tokenizer.decode(p))
    step = results[k]
    assert not step.done and step.reward == -0.2 and step.info["summary_problems"] == [problem]
    after = tokenizer.decode(step.observation.token_ids)
    assert shown in after and len(step.observation.token_ids) <= 500
    assert len(tokenizer.encode(env.managed.summary, add_special_tokens=False)) <= 64
    assert results[-1].done  # the episode went on to its answer


async def test_memory_notes_stay_while_old_turns_go(tokenizer):
    cfg = ContextConfig(strategy="memory", budget=900, keep_turns=2)
    actions = [call("read", page=0), call("note", text="fruit0 came first"), *echoes(6)[1:]]
    env, prompts, results, _ = await episode(tokenizer, cfg, actions)
    system = tokenizer.decode(prompts[0])
    assert '"name": "note"' in system  # the tool is offered
    last = tokenizer.decode(results[-1].observation.token_ids)
    assert "Your notes:\n1. fruit0 came first" in last
    assert fruit(0) not in last and len(env.managed.turns) == 2


async def test_a_note_with_bad_arguments_is_an_error_observation(tokenizer):
    cfg = ContextConfig(strategy="memory", budget=900)
    _, _, results, _ = await episode(tokenizer, cfg, [call("note", words="x")])
    assert results[0].info["tool_errors"] == {"invalid_arguments": 1}
    assert "Error: invalid arguments for note" in tokenizer.decode(results[0].observation.token_ids)


async def test_append_past_its_budget_ends_as_context_overflow(tokenizer):
    _, prompts, results, _ = await episode(tokenizer, ContextConfig(budget=700), echoes(12))
    assert results[-1].done and results[-1].info["termination"] == Termination.CONTEXT_OVERFLOW
    assert all(len(p) <= 700 for p in prompts) and len(results) < 12


async def test_a_budget_smaller_than_the_task_is_one_line_naming_the_key(tokenizer):
    with pytest.raises(
        ValueError, match=r"task.context.budget=100 leaves no room: the system prompt and task take \d+"
    ):
        await episode(tokenizer, ContextConfig(strategy="truncate", budget=100), [])
    with pytest.raises(ValueError, match=r"plus \d+ for task\.context\.summary_tokens=256 and its frame"):
        await episode(tokenizer, ContextConfig(strategy="summarize", budget=400), [])


def test_config_errors_are_one_line():
    with pytest.raises(
        ValueError, match=r"task\.context\.strategy must be one of append, truncate, elide, summarize, memory"
    ):
        ContextConfig(strategy="forget")
    with pytest.raises(ValueError, match=r"strategy=elide needs task\.context\.budget > 0"):
        ContextConfig(strategy="elide")
    with pytest.raises(ConfigError, match=r"unknown config key 'task\.context\.budgett'"):
        TaskSpec.from_raw({"name": "calculator", "context": {"budgett": 5}}, "task", TaskSpec())


def test_any_tool_task_is_managed_from_config_and_the_factory_pickles(tokenizer):
    spec = TaskSpec.from_raw(
        {"name": "calculator", "context": {"strategy": "memory", "budget": 1024}}, "task", TaskSpec()
    )
    assert spec.to_raw()["context"]["strategy"] == "memory"
    factory = pickle.loads(pickle.dumps(spec.env_factory(tokenizer, True, 4)))
    env = factory()
    assert env.context_cfg == ContextConfig(strategy="memory", budget=1024) and "note" in env.tools
    assert spec.with_options({}).context == spec.context  # validation's own options keep it
