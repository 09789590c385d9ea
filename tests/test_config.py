from dataclasses import dataclass, field
from typing import Literal

import pytest

from agent_r1.config import ConfigError, describe, load_config


@dataclass
class Optim:
    lr: float = 1e-5
    """learning rate"""
    betas: tuple[float, ...] = (0.9, 0.999)
    """Adam betas"""


@dataclass
class Cfg:
    model: str = "default"
    """which model"""
    steps: int = 10
    """how many steps"""
    mode: Literal["a", "b"] = "a"
    """a mode"""
    out: str | None = None
    """where"""
    optim: Optim = field(default_factory=Optim)
    """optimizer"""

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\noptim:\n  lr: 0.1\n")
    cfg = load_config(Cfg, str(path), ["optim.lr=2e-4", "mode=b", "optim.betas=[0.5, 0.6]", "out=null"])
    assert cfg.steps == 3 and cfg.mode == "b" and cfg.out is None
    assert cfg.optim.lr == 2e-4 and cfg.optim.betas == (0.5, 0.6)


def test_int_is_accepted_for_float_and_defaults_stay():
    cfg = load_config(Cfg, None, ["optim.lr=1"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.steps == 10


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stpes=3"], "unknown config key 'stpes'; did you mean 'steps'?"),
        (["optim.lrr=3"], "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
        (["steps=many"], "config key 'steps' must be int, got 'many'"),
        (["steps=true"], "config key 'steps' must be int"),
        (["mode=c"], "config key 'mode' must be one of 'a', 'b', got 'c'"),
        (["steps=-1"], "steps must be >= 0, got -1"),
        (["optim=3"], "config key 'optim' is a section"),
        (["steps"], "override 'steps' must look like key.sub=value"),
    ],
)
def test_bad_input_is_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(Cfg, None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(Cfg, str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Cfg, str(bad))


def test_describe_lists_fields_with_docs():
    text = describe(Cfg)
    assert "  steps = 10  # how many steps" in text and "  optim.lr = 1e-05  # learning rate" in text


@pytest.mark.parametrize(
    ("recipe", "config"),
    [
        ("demo.yaml", "pipeline"),
        ("hotpotqa.yaml", "pipeline"),
        ("dossiers.yaml", "pipeline"),
        ("dossiers_cpu.yaml", "pipeline"),
        ("vision.yaml", "pipeline"),
        ("calculator.yaml", "eval"),
        ("gsm8k-gpu.yaml", "train"),
    ],
)
def test_every_recipe_loads_with_its_entry_points_config(recipe, config):
    """A recipe with an unknown key, a bad value or a task option its task lacks fails here, not after
    minutes of a run (only what does not touch a model or data is built)."""
    from pathlib import Path

    from agent_r1.evaluate import EvalConfig
    from agent_r1.pipeline import DemoConfig
    from agent_r1.trainer.config import TrainConfig

    cls = {"pipeline": DemoConfig, "eval": EvalConfig, "train": TrainConfig}[config]
    path = Path(__file__).resolve().parents[1] / "recipes" / recipe
    assert load_config(cls, str(path)) is not None
