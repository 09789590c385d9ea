"""Turn a trajectory's steps into training rows, merging steps whose contexts extend each other.

When step k+1's prompt starts with step k's prompt + response, token for token, the two steps are one
sequence: one forward pass gives every step's log-probs (linear instead of quadratic in turns). The
loss mask is 1 exactly on the sampled ids; prompt and tool ids in between get 0. When the env
rewrote the context, the prefix breaks and a new row starts: nothing is assumed to be append-only.
Images count as part of the context: a prompt extends a row only if it also shows the row's images.
"""

from __future__ import annotations

from agent_r1.types import Image, TrainSequence, Trajectory


def merge_trajectory(traj: Trajectory) -> list[TrainSequence]:
    """Training rows of one trajectory, in step order."""
    rows: list[TrainSequence] = []
    row: TrainSequence | None = None
    for step in traj.steps:
        if row is not None and extends(step.prompt_ids, row.input_ids) and _same_images(step.images, row.images):
            new_prompt = step.prompt_ids[len(row.input_ids) :]
        else:
            row = TrainSequence(traj.traj_id, traj.group_id, [], [], [], [])
            rows.append(row)
            new_prompt = step.prompt_ids
        row.images = list(step.images)  # the row's images are its latest prompt's (responses hold none)
        n, r = len(new_prompt), len(step.response_ids)
        row.input_ids += new_prompt + step.response_ids
        row.loss_mask += [0] * n + [1] * r
        row.logprobs += [0.0] * n + step.response_logprobs
        row.step_index += [-1] * n + [step.index] * r
        row.versions += [-1] * n + [_one_version(step.response_versions)] * r
    return rows


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
