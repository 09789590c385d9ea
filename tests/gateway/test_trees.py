"""An episode as a tree: a harness-like program whose main line spawns a sub-agent, goes on after it, compacts its
context and retries. Each request attaches to the longest earlier request + answer it repeats (not only the
previous one), a rewritten history branches where it diverges, and `merge_trajectory` makes each branch a row
recording the prefix it shares; every sampled id is trained exactly once, as sampled."""

from __future__ import annotations

from openai import OpenAI

from agent_r1.env.prompt_format import ChatFormat
from agent_r1.gateway import ProgramEnvFactory
from agent_r1.rollout.agent_loop import summarize
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.types import Termination
from tests.gateway.test_env import TASK, rollout, tool_model  # noqa: F401 - the fixture

MAIN = {"role": "system", "content": "You are the main agent."}
SUB = {"role": "system", "content": "You are a sub-agent: research one question."}


def harness(task, base_url, api_key):
    """main ask -> sub-agent (two turns) -> main goes on with the sub-agent's finding -> compaction -> retry."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    def ask(messages):
        message = client.chat.completions.create(model="m", messages=messages).choices[0].message
        return message.model_dump(exclude_none=True)

    main = [MAIN, {"role": "user", "content": task["question"]}]
    main.append(ask(main))  # 1: fresh
    sub = [SUB, {"role": "user", "content": "What is 6 * 7?"}]
    sub.append(ask(sub))  # 2: fresh (another system prompt)
    sub += [{"role": "user", "content": "Check it."}]
    finding = ask(sub)  # 3: merged onto 2
    main += [{"role": "user", "content": f"The sub-agent found: {finding.get('content', '')}"}]
    main.append(ask(main))  # 4: merged onto 1, past the sub-agent's requests
    compacted = [MAIN, {"role": "user", "content": "Summary of the work so far: 42."}]
    ask(compacted)  # 5: branched (shares the system prompt)
    return ask(compacted)  # 6: the same request again (a retry): branched, the same prompt


def test_a_harness_episode_is_a_tree_of_rows(tool_model, tokenizer):  # noqa: F811
    factory = ProgramEnvFactory(tokenizer, function=harness, max_turns=8)
    (traj,) = rollout(tool_model, tokenizer, factory)
    assert traj.termination == Termination.ANSWERED, traj.error
    s = traj.steps
    assert len(s) == 6
    fmt = ChatFormat(tokenizer)
    assert s[1].prompt_ids == fmt.initial([SUB, {"role": "user", "content": "What is 6 * 7?"}])
    # 3 and 4 extend 2 and 1, token for token: the earlier prompt + its sampled ids + the new turn's delta
    assert s[2].prompt_ids[: len(s[1].prompt_ids) + len(s[1].response_ids)] == s[1].prompt_ids + s[1].response_ids
    assert s[3].prompt_ids[: len(s[0].prompt_ids) + len(s[0].response_ids)] == s[0].prompt_ids + s[0].response_ids
    assert s[5].prompt_ids == s[4].prompt_ids  # the retry sees exactly the prompt it retries
    rows = merge_trajectory(traj)
    assert len(rows) == 4  # main line (1+4), sub-agent (2+3), compaction (5), retry (6)
    main, sub, compaction, retry = rows
    assert main.input_ids == s[3].prompt_ids + s[3].response_ids
    assert sub.input_ids == s[2].prompt_ids + s[2].response_ids

    # the branches record what they share, found by direct comparison here
    def shared(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    assert (compaction.parent, compaction.shared) == (0, shared(s[4].prompt_ids, main.input_ids))
    assert compaction.shared >= len(fmt.initial([MAIN])) - 1  # at least the system prompt's turn
    assert (retry.parent, retry.shared) == (2, len(s[5].prompt_ids))  # its whole prompt
    # every sampled id trained once, in the row that sampled it, as sampled
    trained = sorted(  # stable: by step, each step's ids in their row's order
        ((k, t) for row in rows for t, m, k in zip(row.input_ids, row.loss_mask, row.step_index, strict=True) if m),
        key=lambda kt: kt[0],
    )
    assert [t for _, t in trained] == [t for step in s for t in step.response_ids]
    metrics = summarize([traj])  # requests 2-6: fresh, merged, merged, branched, branched
    assert metrics["gateway/merged_steps"] == 2 and metrics["gateway/branched_steps"] == 2
    assert metrics["gateway/fresh_steps"] == 1


SEEN: dict = {}


def score_the_sub_agent(task, episode, output):
    """The outcome 1, and 0.25 for each step of the sub-agent's branch (its requests start with its system prompt)."""
    SEEN["attached"] = [s.attached for s in episode.steps]
    return 1.0, {}, {k: 0.25 for k, s in enumerate(episode.steps[:-1]) if s.messages[0] == SUB}


def score_the_last_step(task, episode, output):
    return 1.0, {}, {len(episode.steps) - 1: 0.5}  # the last step's reward is the outcome: refused


def test_a_reward_function_scores_the_branches_of_the_tree(tool_model, tokenizer):  # noqa: F811
    factory = ProgramEnvFactory(tokenizer, function=harness, reward=score_the_sub_agent, max_turns=8)
    (traj,) = rollout(tool_model, tokenizer, factory)
    assert traj.termination == Termination.ANSWERED, traj.error
    assert SEEN["attached"] == ["fresh", "fresh", "merged", "merged", "branched", "branched"]
    assert [s.reward for s in traj.steps] == [None, 0.25, 0.25, None, None, 1.0]
    assert traj.process_rewards == [0.0, 0.25, 0.25, 0.0, 0.0, 0.0] and traj.outcome == 1.0
    factory = ProgramEnvFactory(tokenizer, function=harness, reward=score_the_last_step, max_turns=8)
    (bad,) = rollout(tool_model, tokenizer, factory)
    assert bad.termination == Termination.ERROR and "give an earlier step's index, in [0, 5)" in bad.error
