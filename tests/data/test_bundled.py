"""The bundled datasets: present in the package, verified, and a clear one-line error when damaged."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from agent_r1.data import bundled as bundled_mod
from agent_r1.data.bundled import SHA256, bundled


@pytest.mark.parametrize(("name", "rows", "keys"), [
    ("gsm8k/train.jsonl", 7473, {"question", "answer"}),
    ("hotpotqa/train.jsonl", 300, {"id", "question", "answer", "supporting_facts", "context"}),
    ("hotpotqa/dev.jsonl", 300, {"id", "question", "answer", "supporting_facts", "context"}),
])  # fmt: skip
def test_every_bundled_file_is_in_the_package_whole(name, rows, keys):
    path = bundled(name)
    assert path.is_relative_to(bundled_mod.FILES) and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256[name]
    lines = path.read_text().splitlines()
    assert len(lines) == rows and keys <= json.loads(lines[0]).keys()


def test_the_licences_ship_beside_the_data():
    sources = (bundled_mod.FILES / "SOURCES.md").read_text()
    assert "MIT License" in sources and "Copyright (c) 2021 OpenAI" in sources and "CC BY-SA 4.0" in sources


@pytest.fixture
def copy_of_files(tmp_path, monkeypatch):
    """The bundled files copied aside, so a test can damage them; the check cache is cleared around it."""
    files = tmp_path / "files"
    shutil.copytree(bundled_mod.FILES, files)
    monkeypatch.setattr(bundled_mod, "FILES", files)
    bundled_mod._verified.cache_clear()
    yield files
    bundled_mod._verified.cache_clear()


def test_a_missing_file_is_named_with_how_to_restore_it(copy_of_files):
    (copy_of_files / "gsm8k" / "train.jsonl").unlink()
    with pytest.raises(ValueError, match=r"gsm8k/train.jsonl is missing: restore it with `git checkout") as err:
        bundled("gsm8k/train.jsonl")
    assert "\n" not in str(err.value) and "pip install --force-reinstall agent-r1" in str(err.value)


def test_a_truncated_or_edited_file_is_corrupted_not_silently_used(copy_of_files):
    path = copy_of_files / "hotpotqa" / "dev.jsonl"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"hotpotqa/dev.jsonl is corrupted .*restore it"):
        bundled("hotpotqa/dev.jsonl")
    assert bundled("hotpotqa/train.jsonl") == copy_of_files / "hotpotqa" / "train.jsonl"  # the others are fine


def test_an_unknown_name_lists_the_bundled_ones():
    with pytest.raises(ValueError, match=r"no bundled data file 'gsm8k/test.jsonl' \(there are: gsm8k/train.jsonl"):
        bundled("gsm8k/test.jsonl")
