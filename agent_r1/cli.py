"""`agent-r1 <command> [CONFIG.yaml] [key.sub=value ...]`.

Every command takes an optional YAML config and `key=value` overrides into its one typed config.
Bad input (unknown key, missing model, unreadable data) ends with one line naming what is wrong.
"""

from __future__ import annotations

import argparse
import sys

from agent_r1.config import ConfigError, describe, load_config
from agent_r1.evaluate import EvalConfig, run_eval
from agent_r1.observe.plot import PlotConfig, plot_run
from agent_r1.observe.viewer.app import ViewConfig, serve_viewer
from agent_r1.pipeline import DemoConfig, run_demo
from agent_r1.retrieval.server import RetrievalServerConfig, serve_retrieval
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.rl import train
from agent_r1.trainer.sft import SFTConfig, sft

# name: (config class, entry point, help, config field a bare argument fills; None = a YAML config file)
COMMANDS = {
    "demo": (DemoConfig, run_demo, "the main job: eval -> SFT cold start -> RL -> eval, with a results table", None),
    "train": (TrainConfig, train, "RL on a recipe (GRPO, PPO, REINFORCE++, RLOO, ...)", None),
    "sft": (SFTConfig, sft, "cold-start SFT on multi-turn tool-use demonstrations", None),
    "eval": (EvalConfig, run_eval, "evaluate a model on a recipe's tasks with its tools", None),
    "view": (ViewConfig, serve_viewer, "browse a run's trajectories in a local web page", "run_dir"),
    "plot": (PlotConfig, plot_run, "PNG curves of a run's metrics (reward, accuracy, tools, KL, entropy)", "run_dir"),
    "retrieval-server": (
        RetrievalServerConfig,
        serve_retrieval,
        "serve a search index over HTTP to rollout workers",
        None,
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent-r1", description="RL for multi-turn, tool-using LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (cls, _, help_text, positional) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            epilog="config keys:\n" + describe(cls),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("args", nargs="*", metavar=f"{(positional or 'CONFIG.yaml').upper()} | key=value")
    ns = parser.parse_args(argv)
    cls, run, _, positional = COMMANDS[ns.command]
    paths = [a for a in ns.args if "=" not in a]
    overrides = [a for a in ns.args if "=" in a]
    try:
        if len(paths) > 1:
            raise ConfigError(f"give at most one {positional or 'config file'}, got {', '.join(paths)}")
        if positional and paths:
            overrides.insert(0, f"{positional}={paths.pop()}")
        cfg = load_config(cls, paths[0] if paths else None, overrides)
        run(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"agent-r1 {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
