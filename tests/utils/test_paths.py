"""write_text_atomic: the old file or the new one, never half of one, and no temporary file left."""

from __future__ import annotations

import os

import pytest

from agent_r1.utils import paths


def test_write_text_atomic_replaces_whole_and_leaves_nothing_behind(tmp_path, monkeypatch):
    target = tmp_path / "config.yaml"
    paths.write_text_atomic(target, "steps: 1\n")
    paths.write_text_atomic(target, "steps: 2\n")
    assert target.read_text() == "steps: 2\n" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]

    def killed(src, dst):  # the process dies between writing the temporary file and the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        paths.write_text_atomic(target, "steps: 3\n")
    assert target.read_text() == "steps: 2\n"  # the old file, whole
