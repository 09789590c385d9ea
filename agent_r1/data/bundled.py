"""The datasets that ship inside the package (agent_r1/data/files/, licences in its SOURCES.md).

They live in the package, not beside the repository, so a clone, an editable install and a wheel
installed anywhere all find them. Each file is checked once per process against the SHA-256 it
shipped with: a file that is missing, truncated or edited ends the run with one line that names it
and says how to restore it, instead of training on a silently different split.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

FILES = Path(__file__).with_name("files")
SHA256 = {
    "gsm8k/train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "hotpotqa/train.jsonl": "e587f80176337ff705ca2f9c178f2bd784280b388abf302ad4071c482baa0dfb",
    "hotpotqa/dev.jsonl": "c6fa5317cc316b65b3c82d441ea641aef4a588b4aaec9377bbd167637d8665e8",
}
RESTORE = (
    "restore it with `git checkout -- agent_r1/data/files` in a clone, or `pip install --force-reinstall agent-r1`"
)


def bundled(name: str) -> Path:
    """The path of a bundled data file (`gsm8k/train.jsonl`), verified against its checksum."""
    if name not in SHA256:
        raise ValueError(f"no bundled data file {name!r} (there are: {', '.join(SHA256)})")
    return _verified(name)


@functools.cache
def _verified(name: str) -> Path:
    path = FILES / name
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        raise ValueError(f"bundled data file {path} is missing: {RESTORE}") from None
    if digest != SHA256[name]:
        raise ValueError(f"bundled data file {path} is corrupted (its SHA-256 differs): {RESTORE}")
    return path
