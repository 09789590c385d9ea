"""Turn a trajectory's steps into training rows, merging steps whose contexts extend each other.

When a step's prompt starts with an earlier step's prompt + response, token for token, the two steps are
one sequence: one forward pass gives every step's log-probs (linear instead of quadratic in turns). The
loss mask is 1 exactly on the sampled ids; prompt and tool ids in between get 0. When the env rewrote the
context, the prefix breaks and a new row starts: nothing is assumed to be append-only.

An episode may be a tree, not a line (an agent harness's sub-agents, a retry, a compaction): a step joins
the row it extends, whichever row that is, not only the latest; a step that extends none starts a row,
which records the longest prefix it shares with an earlier row (`TrainSequence.parent`, `.shared`). The
shared tokens are prompt there (mask 0), so every sampled id is trained once, in the row that sampled it;
the update computes a shared prefix once (trainer/batching.py). Images count as part of the context: a
prompt extends a row only if it also shows the row's images. A step the env marks `unseen` (the gateway:
its program's connection closed before the answer reached it) stays in its row as context, untrained: the
episode went on as if it had never been sampled.
"""

from __future__ import annotations

from agent_r1.types import Image, TrainSequence, Trajectory


def merge_trajectory(traj: Trajectory) -> list[TrainSequence]:
    """Training rows of one trajectory, in the order their first steps came."""
    rows: list[TrainSequence] = []
    for step in traj.steps:
        joins = [r for r in rows if extends(step.prompt_ids, r.input_ids) and _same_images(step.images, r.images)]
        if joins:
            row = max(joins, key=lambda r: len(r.input_ids))
            new_prompt = step.prompt_ids[len(row.input_ids) :]
        else:
            row = TrainSequence(traj.traj_id, traj.group_id, [], [], [], [])
            row.parent, row.shared = _longest_shared(step.prompt_ids, rows)
            rows.append(row)
            new_prompt = step.prompt_ids
        row.images = list(step.images)  # the row's images are its latest prompt's (responses hold none)
        n, r = len(new_prompt), len(step.response_ids)
        row.input_ids += new_prompt + step.response_ids
        row.loss_mask += [0] * n + [0 if step.info.get("unseen") else 1] * r
        row.logprobs += [0.0] * n + step.response_logprobs
        row.step_index += [-1] * n + [step.index] * r
        row.versions += [-1] * n + [_one_version(step.response_versions)] * r
        if step.grammar is not None:
            row.grammars[step.index] = step.grammar
    return rows


def _longest_shared(prompt: list[int], rows: list[TrainSequence]) -> tuple[int, int]:
    """(index of the earlier row sharing the longest token prefix with `prompt`, its length); (-1, 0) if none."""
    best = (-1, 0)
    for i, row in enumerate(rows):
        if (n := common_prefix(prompt, row.input_ids)) > best[1]:
            best = (i, n)
    return best


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; binary search, each test one slice compare in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _one_version(versions: list[int] | None) -> int:
    """The version that sampled every token of a step, -1 if it spans an update (or is not tracked): only a
    step sampled wholly by one version was computed, prompt included, by exactly those weights."""
    return versions[0] if versions and min(versions) == max(versions) else -1


def merge_trajectories(trajs: list[Trajectory]) -> list[TrainSequence]:
    """Training rows of many trajectories, flattened."""
    return [row for t in trajs for row in merge_trajectory(t)]


def _same_images(prompt: list[Image], row: list[Image]) -> bool:
    """The prompt shows the row's images first, the same pixels in the same order: identical placeholder
    ids can stand for different images, so ids alone do not say that a prompt extends a row."""
    return len(prompt) >= len(row) and all(a.digest == b.digest for a, b in zip(prompt, row, strict=False))


def extends(prompt: list[int], context: list[int]) -> bool:
    """True when `prompt` is `context` followed by zero or more new tokens."""
    return len(prompt) >= len(context) and prompt[: len(context)] == context
