"""The docs stay true: every relative link and anchor resolves on GitHub, every `agent-r1 …` command line
the user pages show parses with its keys (a dry validation of its config, nothing run), every figure in
README.md is on docs/results.md (where each figure names its command), and the user pages speak of the
project, not of the runs that built it (history lives in CHANGELOG.md and docs/log/)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from agent_r1.cli import COMMANDS, parse
from agent_r1.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/log/ is history
ALL_PAGES = [*USER_PAGES, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs" / "log").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def prose(text: str) -> str:
    """The text without fenced blocks and code spans: a `[x](y)` inside code is not a link."""
    return CODE_SPAN.sub(" ", FENCE.sub("\n", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, every character that is not a letter, a
    digit, '-', '_' or a space dropped, spaces turned into '-' (github/cmark-gfm's `toc` filter)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor `page` has: one per heading (a repeated slug gets -1, -2, ... as GitHub numbers them),
    and explicit `<a id=...>` tags."""
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(page.read_text()))
    for _, heading in HEADING.findall(FENCE.sub("\n", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves_without_a_symlink(page):
    """A link through a symlinked folder (`recipes/` links to agent_r1/recipes/) works in a clone but not on
    GitHub's web view, which does not follow it."""
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        lexical = Path(*(page.parent / path).parts) if path else page
        hops = [p for p in [lexical, *lexical.parents] if p.is_symlink()]
        if hops:
            broken.append(f"{target}: goes through the symlink {hops[0].relative_to(ROOT)}")
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_slug_is_githubs():
    """Hand-checked against GitHub's rendering of this repository's own headings."""
    assert slug("Asynchronous RL (`rollout.max_staleness`)") == "asynchronous-rl-rolloutmax_staleness"
    assert slug("τ²-bench") == "τ²-bench"
    assert slug("Splits, validation and the best checkpoint") == "splits-validation-and-the-best-checkpoint"
    assert slug("Turn-level credit (`turn_grpo`, `gigpo`)") == "turn-level-credit-turn_grpo-gigpo"


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A part\n\n[ok](#a-part) [bad](#no-part) [gone](missing.md) `[code](x.md)`\n")
    targets = links(page)
    assert targets == ["#a-part", "#no-part", "missing.md"]
    assert "a-part" in anchors(page) and "no-part" not in anchors(page)


PLACEHOLDER = re.compile(r"[\[\]<>…|]|\.\.\.")


def command_lines(page: Path) -> list[str]:
    """`agent-r1 …` lines in the page's shell blocks and code spans, with their comments, line continuations
    and shell operators removed, leaving out synopsis lines that hold placeholders (`[CONFIG.yaml]`,
    `<command>`, `a|b`, `...`) and code spans that only name a command (`agent-r1 view`)."""
    text = page.read_text()
    lines = []
    for lang, block in re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S):
        if lang in ("", "bash", "sh", "shell", "console"):
            lines += [(line, 2) for line in block.replace("\\\n", " ").splitlines()]
    lines += [(m.group(2), 3) for m in CODE_SPAN.finditer(FENCE.sub("\n", text))]
    out = []
    for line, least in lines:
        line = re.sub(r"^\s*\$?\s*", "", line)
        if not line.startswith("agent-r1 "):
            continue
        line = re.split(r"\s+#\s|\s+&&?(?:\s|$)|\s+[|;>]\s", line)[0].strip()  # its comment, `&`, a pipe
        tokens = shlex.split(line)
        if len(tokens) < least or any(PLACEHOLDER.search(t) for t in tokens):
            continue
        out.append(line)
    return out


def task_modules(tmp_path: Path) -> None:
    """The task modules the pages show as `# my_pkg/my_task.py` blocks, written out and importable, so that
    the commands that name them are checked against their real options."""
    for page in USER_PAGES:
        for block in re.findall(r"^```python\n# ([\w/]+\.py)\b.*?\n(.*?)^```", page.read_text(), re.M | re.S):
            path = tmp_path / block[0]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block[1])
            (path.parent / "__init__.py").touch()


@pytest.fixture
def documented_modules(tmp_path, monkeypatch):
    task_modules(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT))  # examples.shop_task, run from the repository root
    monkeypatch.chdir(ROOT)
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "my_pkg"]:
        del sys.modules[name]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_line_parses_with_its_keys(page, documented_modules):
    """`agent-r1 <command> ...` as the page shows it builds that command's typed config: an unknown or
    renamed key, a task option that does not exist or a bad value fails here, as it would for a user."""
    failures = []
    for line in command_lines(page):
        name, *args = shlex.split(line)[1:]
        if name not in COMMANDS:
            failures.append(f"{line!r}: no command {name!r}")
            continue
        args = [a for a in args if a not in ("--verbose", "--help")]
        try:
            parse(name, args)
        except (ConfigError, ValueError, OSError) as exc:
            failures.append(f"{line!r}: {exc}")
    assert not failures, "\n".join(failures)


def test_the_command_check_catches_a_bad_key(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nagent-r1 train algo.estimator=rloo rollout.temprature=0.5  # a typo\n```\n")
    (line,) = command_lines(page)
    with pytest.raises(ConfigError, match=r"did you mean 'rollout\.temperature'"):
        parse("train", shlex.split(line)[2:])


FIGURE = re.compile(
    r"[+−-]?\d[\d,]*(?:\.\d+)?\s?(?:%|×|GiB|GB|MiB|MB|min(?:utes)?\b|s\b|ms\b|tok/s|tokens/s|requests/s|EM\b|points\b)"
)


def figures(text: str) -> set[str]:
    """Measured figures: a number with its unit (`67.2%`, `3.74 GiB`, `15 min`, `5.2×`), outside code."""
    return {re.sub(r"\s+", " ", f) for f in FIGURE.findall(prose(text))}


def test_every_figure_in_the_readme_is_on_the_results_page():
    results = re.sub(r"\s+", " ", (ROOT / "docs" / "results.md").read_text())
    missing = sorted(f for f in figures((ROOT / "README.md").read_text()) if f not in results)
    assert figures((ROOT / "README.md").read_text()), "the README states no figure: the check would pass on nothing"
    assert not missing, f"README.md states figures that docs/results.md does not: {missing}"


def test_every_results_row_names_its_command():
    """docs/results.md: a table row whose last cell holds no command is a figure nobody can reproduce; those
    go under "Not reproducible by one command", which says why."""
    text = (ROOT / "docs" / "results.md").read_text()
    body = text.split("## Not reproducible by one command")[0]
    rows = [r for r in body.splitlines() if r.startswith("|") and not re.match(r"\|\s*-", r)]
    data = [r for r in rows if not r.lower().startswith("| figure")]
    assert data, "no result rows"
    bad = [r for r in data if "`" not in r.rstrip().rstrip("|").split("|")[-1]]
    assert not bad, "rows without a command:\n" + "\n".join(bad)


DIARY = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\w+teenth|twenty[\w-]*|this|that|"
    r"previous|last|next|latest) session\b|\bissue \d+|\(target [+−-]|\bthe issue's\b|benchmarks\.md",
    re.I,
)


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_speak_of_the_project_not_of_its_runs(page):
    found = sorted({m.group(0) for m in DIARY.finditer(page.read_text())})
    assert not found, f"{page.relative_to(ROOT)} refers to sessions, issues or targets: {found}"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
