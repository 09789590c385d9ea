"""How real harness sessions attach to the episode's tree: a Claude Code session that spawns a sub-agent, and an
OpenClaw session, each run for real through the gateway with the policy's answers scripted (the harness decides
every request: its prompts, its sub-agent, what it sends back).

    python benchmarks/harness_trees.py            # needs `make harnesses`

For each session: the steps after the first and how each attached (merged, branched, fresh), the share that
attached to an earlier prefix, the rows `merge_trajectory` makes, and the tokens each row shares with an earlier
row (a fresh row may still share a token prefix: the trie of the update computes it once). Every sampled id
must be trained exactly once, as sampled: checked here.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer

from agent_r1.env.tool_calls import format_tool_call
from agent_r1.gateway import ProgramEnvFactory
from agent_r1.models.loading import resolve_model_path
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.types import Action, Step, Trajectory
from tests.gateway.test_harnesses import CLAUDE_ENV, COMMAND, TASK, reward
from tests.gateway.test_openclaw import OPENCLAW

MARK = "SUBTASK-7"  # in the sub-agent's prompt: how the script tells its requests from the main line's


def claude_answer(messages: list[dict]) -> tuple[str, str]:
    """Main line: spawn a sub-agent (Agent tool, in the foreground), then Bash, then done. Sub-agent: Bash, done."""
    tools_run = sum(m["role"] == "tool" for m in messages)
    first_user = next((m for m in messages if m["role"] == "user"), {})
    if MARK in json.dumps(first_user):  # the sub-agent's own conversation
        if tools_run == 0:
            return format_tool_call("Bash", {"command": "echo sub > sub.txt", "description": "Write sub.txt"}), "stop"
        return "Sub-agent done: sub.txt written.", "eos"
    if tools_run == 0:
        prompt = f"{MARK}: write sub.txt saying sub."
        call = {"description": "Write sub file", "prompt": prompt, "subagent_type": "general-purpose"}
        return format_tool_call("Agent", call | {"run_in_background": False}), "stop"
    if tools_run == 1:
        return format_tool_call("Bash", {"command": "echo hi > hello.txt", "description": "Write hello.txt"}), "stop"
    return "Done: hello.txt says hi.", "eos"


def openclaw_answer(messages: list[dict]) -> tuple[str, str]:
    """Two exec calls, then done."""
    tools_run = sum(m["role"] == "tool" for m in messages)
    if tools_run < 2:
        command = "echo hi > hello.txt" if tools_run == 0 else "cat hello.txt"
        return format_tool_call("exec", {"command": command, "title": "Step"}), "stop"
    return "Done: hello.txt says hi.", "eos"


async def session(factory: ProgramEnvFactory, answer, tokenizer) -> Trajectory:
    env = factory()
    traj = Trajectory(TASK, "t", "g")
    obs = await env.reset(TASK)
    try:
        for k in range(12):
            text, finish = answer([m.model_dump(exclude_none=True) for m in env.request_messages])
            ids = tokenizer.encode(text, add_special_tokens=False) + (
                [tokenizer.eos_token_id] if finish == "eos" else []
            )
            result = await env.step(Action(ids, [0.0] * len(ids), text, finish))
            traj.steps.append(Step(obs.token_ids, ids, [0.0] * len(ids), result.reward, result.info, text, k))
            if result.done:
                traj.steps[-1].done = True
                break
            obs = result.observation
    finally:
        await env.close()
    return traj


def report(name: str, traj: Trajectory) -> None:
    kinds = {kind: sum(s.info.get("metrics", {}).get(f"gateway/{kind}_steps", 0) for s in traj.steps)
             for kind in ("merged", "branched", "fresh")}  # fmt: skip
    later = sum(kinds.values())
    rows = merge_trajectory(traj)
    trained = [
        (k, t) for row in rows for t, m, k in zip(row.input_ids, row.loss_mask, row.step_index, strict=True) if m
    ]
    exact = [t for _, t in sorted(trained, key=lambda kt: kt[0])] == [t for s in traj.steps for t in s.response_ids]
    print(f"{name}: {len(traj.steps)} steps, reward {traj.outcome}; later requests {later}: {kinds}; "
          f"attached {(kinds['merged'] + kinds['branched']) / max(later, 1):.0%}")  # fmt: skip
    for i, row in enumerate(rows):
        steps = sorted({k for k in row.step_index if k >= 0})
        print(f"  row {i}: steps {steps}, {len(row.input_ids)} tokens, shares {row.shared} with row {row.parent}")
    tokens = sum(len(r.input_ids) for r in rows)
    print(f"  tokens in rows {tokens}, shared with an earlier row {sum(r.shared for r in rows)}; "
          f"every sampled id trained once, as sampled: {exact}")  # fmt: skip


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    common = dict(reward=reward, max_turns=12, timeout_s=120, scratch=True)
    claude = ProgramEnvFactory(tokenizer, command=COMMAND, env=CLAUDE_ENV, **common)
    report("Claude Code with a sub-agent", asyncio.run(session(claude, claude_answer, tokenizer)))
    openclaw = ProgramEnvFactory(tokenizer, command=OPENCLAW, **common)
    report("OpenClaw", asyncio.run(session(openclaw, openclaw_answer, tokenizer)))


if __name__ == "__main__":
    main()
