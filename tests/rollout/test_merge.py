from agent_r1.rollout.merge import merge_trajectory
from agent_r1.types import Step, Trajectory


def traj(*steps):
    return Trajectory(task={}, traj_id="t", group_id="g", steps=[Step(*s, index=i) for i, s in enumerate(steps)])


def test_append_only_steps_merge_into_one_row_with_exact_masks():
    t = traj(
        ([1, 2, 3], [4, 5], [-0.4, -0.5]),
        ([1, 2, 3, 4, 5, 6, 7], [8], [-0.8]),  # prompt = previous prompt + response + tool ids 6, 7
        ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [-0.9, -1.0]),  # nothing in between
    )
    (row,) = merge_trajectory(t)
    assert row.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert row.logprobs == [0, 0, 0, -0.4, -0.5, 0, 0, -0.8, -0.9, -1.0]
    assert row.step_index == [-1, -1, -1, 0, 0, -1, -1, 1, 2, 2]


def test_rewritten_context_starts_a_new_row():
    t = traj(
        ([1, 2, 3], [4, 5], [-0.4, -0.5]),
        ([1, 2, 9, 6], [7], [-0.7]),  # env rewrote the context: not an extension
        ([1, 2, 9, 6, 7, 11], [12], [-1.2]),  # extends the rewritten one again
    )
    rows = merge_trajectory(t)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [1, 2, 9, 6, 7, 11, 12]]
    assert [r.loss_mask for r in rows] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 0, 1]]
    assert rows[1].step_index == [-1, -1, -1, -1, 1, -1, 2]
    assert [(r.parent, r.shared) for r in rows] == [(-1, 0), (0, 2)]  # the branch shares [1, 2] with row 0


def test_a_step_joins_the_row_it_extends_not_only_the_latest():
    """A tree: a sub-agent's step (its own row) comes between two steps of the main line, which stay one row."""
    t = traj(
        ([1, 2], [3], [-0.3]),  # main line
        ([7, 8], [9], [-0.9]),  # a sub-agent: nothing in common
        ([1, 2, 3, 4], [5], [-0.5]),  # the main line goes on
        ([7, 8, 9, 6], [4], [-0.4]),  # and the sub-agent
    )
    rows = merge_trajectory(t)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [7, 8, 9, 6, 4]]
    assert [r.step_index for r in rows] == [[-1, -1, 0, -1, 2], [-1, -1, 1, -1, 3]]
    assert [(r.parent, r.shared) for r in rows] == [(-1, 0), (-1, 0)]


def test_a_prompt_shorter_than_the_context_is_not_an_extension():
    t = traj(([1, 2, 3], [4], [-0.4]), ([1, 2], [5], [-0.5]))
    assert len(merge_trajectory(t)) == 2
