"""A newcomer's machine: `pip install .` (a wheel, not editable) and `agent-r1 demo` from another directory.

The wheel must carry everything a run reads (the recipes, the bundled data and their licences): nothing
may come from the clone. The venv gets the wheel and, through a .pth line, the test venv's third-party
packages (a real `pip install .` would download them; nothing is downloaded here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding agent-r1 installed from its wheel; returns its bin directory."""
    root = tmp_path_factory.mktemp("fresh")
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(REPO), "-w", str(root)], check=True)
    (wheel,) = root.glob("agent_r1-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    (site,) = (root / "venv").glob("lib/python*/site-packages")
    (site / "third_party.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # not the editable finder
    subprocess.run([*pip, "--python", str(root / "venv/bin/python"), "install", "--no-deps", str(wheel)], check=True)
    return root / "venv" / "bin"


def run(bin_dir: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_installed_package_finds_its_data_and_recipes_from_anywhere(installed, tmp_path):
    probe = (
        "import json, agent_r1\n"
        "from agent_r1.tasks import gsm8k, hotpotqa\n"
        "from agent_r1.config import RECIPES\n"
        "print(json.dumps([agent_r1.__file__, len(gsm8k.load(split='test')), len(hotpotqa.load(split='test')),"
        " len(hotpotqa.corpus()), sorted(p.name for p in RECIPES.glob('*.yaml'))]))"
    )
    out = run(installed, [str(installed / "python"), "-c", probe], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    where, gsm8k_test, hotpot_dev, passages, recipes = json.loads(out.stdout)
    assert Path(where).is_relative_to(installed.parent) and not Path(where).is_relative_to(REPO)
    assert (gsm8k_test, hotpot_dev, passages) == (714, 300, 5912)  # the split sizes the docs state
    assert {"demo.yaml", "calculator.yaml", "hotpotqa.yaml"} <= set(recipes)


@pytest.mark.slow
def test_agent_r1_demo_runs_from_another_directory(installed, tmp_path, tiny_model_dir):
    """`agent-r1 demo` alone takes the bundled demo recipe (shrunk here by overrides to a tiny model)."""
    args = [
        str(installed / "agent-r1"), "demo", f"model={tiny_model_dir}",
        "eval.num_tasks=2", "eval.max_new_tokens=8", "sft.num_examples=4", "sft.epochs=1",
        "rl.steps=1", "rl.rollout.tasks_per_step=2", "rl.rollout.group_size=2", "rl.rollout.max_new_tokens=8",
        "rl.val.every=1", "rl.val.num_tasks=2",
    ]  # fmt: skip
    out = run(installed, args, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "runs/demo/results.json").read_text())["results"]
    assert set(results) == {"untrained", "sft", "rl"}
    # the recipe's settings, not DemoConfig's defaults: RL trained on the recipe's task mix with its KL
    config = yaml.safe_load((tmp_path / "runs/demo/rl/config.yaml").read_text())
    assert config["task"]["ops"] == [1, 2, 2] and config["algo"]["kl_coef"] == 0.1
