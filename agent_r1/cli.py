"""`agent-r1 <command> [CONFIG.yaml] [key.sub=value ...]`.

Every command takes an optional YAML config and `key=value` overrides into its one typed config.
`--key value` (and a bare `--flag` for a boolean) is the same as `key=value`, for the commands people
type by hand (`agent-r1 chat --model DIR --tools calculator,echo`). Bad input (unknown key, missing
model, unreadable data) ends with one line naming what is wrong. Third-party progress bars (transformers'
weight loading and shard writing) are hidden unless `--verbose` is given, anywhere on the line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import typing

from agent_r1.config import RECIPES, ConfigError, describe, load_config
from agent_r1.utils.malloc import fix_mmap_threshold, freeze_imported

# name -> (module, config class, function, help). A command's module is imported when it runs or its
# --help is read: `agent-r1 --help`, `agent-r1 plot` and a mistyped key do not wait ~4 s for torch and
# transformers, and a command pays only for what it imports.
COMMANDS = {
    "demo": (
        "agent_r1.pipeline", "DemoConfig", "run_demo",
        "the main job: eval -> SFT cold start -> RL -> eval, with a results table",
    ),
    "train": ("agent_r1.trainer.rl", "TrainConfig", "train", "RL on a task (GRPO, PPO, REINFORCE++, RLOO, ...)"),
    "sft": ("agent_r1.trainer.sft", "SFTConfig", "sft", "cold-start SFT on multi-turn tool-use demonstrations"),
    "eval": ("agent_r1.evaluate", "EvalConfig", "run_eval", "evaluate a model on a task's problems with its tools"),
    "chat": (
        "agent_r1.chat", "ChatConfig", "run_chat",
        "talk to a tool-using model in the terminal, or answer one --prompt",
    ),
    "serve": (
        "agent_r1.serve.server", "ServeConfig", "run_serve",
        "OpenAI-compatible server: chat with tools, token-id completions",
    ),
    "learn": (
        "agent_r1.online.learn", "LearnConfig", "run_learn",
        "train a serve --learn server's model on its live traffic (docs/online.md)",
    ),
    "rollback": (
        "agent_r1.online.learn", "RollbackConfig", "run_rollback",
        "serve a kept version again (serve --learn, agent-r1 learn)",
    ),
    "export": (
        "agent_r1.trainer.export", "ExportConfig", "run_export",
        "checkpoint -> Hugging Face directory (LoRA merged)",
    ),
    "view": (
        "agent_r1.observe.viewer.app", "ViewConfig", "serve_viewer",
        "browse a run's trajectories in a local web page",
    ),
    "plot": (
        "agent_r1.observe.plot", "PlotConfig", "plot_run",
        "PNG curves of a run's metrics (reward, accuracy, tools, KL, entropy)",
    ),
    "retrieval-server": (
        "agent_r1.retrieval.server", "RetrievalServerConfig", "serve_retrieval",
        "serve a search index to rollout workers",
    ),
}  # fmt: skip
# errors that stop a run with its checkpoints whole (the remote engine went away, no episode can run):
# (module, class), looked up only in a process that imported the module, the only one that can raise them
STOPS = (("agent_r1.engines.remote_engine", "RemoteEngineError"), ("agent_r1.rollout.producer", "RolloutStalled"))
# a bare argument that is not a .yaml file sets this key
POSITIONAL = {"export": "checkpoint", "view": "run_dir", "plot": "run_dir"}


def exit_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, `kill`, Slurm or Kubernetes ending a job) exit the way Ctrl-C does, through
    `finally` blocks and atexit. Python's default dies at once, so the servers a command started as its
    children (a τ² customer's `agent-r1 serve`, an OpenEnv app: agent_r1/utils/servers.py) lived on, each
    holding its memory and port. Left alone where the caller already chose a handler."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_143)


def _exit_143(signum: int, frame: object) -> None:
    """Once: a second SIGTERM (`timeout` forwards its own, a scheduler may repeat it) would interrupt the
    exit it started, halfway through stopping the servers."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    fix_mmap_threshold()  # long CPU runs otherwise fragment the heap (agent_r1/utils/malloc.py)
    own = argv is None  # the process's own command line (not a caller's, such as a test runner's)
    if own:
        exit_on_sigterm()
    parser = argparse.ArgumentParser(
        prog="agent-r1",
        description="RL for multi-turn, tool-using LLM agents",
        epilog="--verbose (anywhere): show third-party progress bars (weight loading, shard writing)",
    )
    argv = sys.argv[1:] if argv is None else argv
    verbose = "--verbose" in argv  # third-party progress bars (weights loading, shards) only when asked
    argv = [a for a in argv if a != "--verbose"]
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    cls, run = command(chosen) if chosen else (None, None)
    if own and chosen:  # the command's imports are what the process holds now: out of the collector's walks
        freeze_imported()  # (0.16 s a full collection, 3-4 of them an RL step; utils/malloc.py)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (*_, help_text) in COMMANDS.items():
        keys = "config keys (set as key=value or --key value):\n" + describe(cls) if name == chosen else None
        p = sub.add_parser(name, help=help_text, epilog=keys, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    if chosen:
        quiet_third_party(not verbose)
        log_to_terminal()
        argv = [chosen, *flags_to_overrides(cls, argv[1:])]
    ns = parser.parse_args(argv)  # no command: usage and exit
    try:
        run(parse(ns.command, ns.args))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun rank: its work is done and written
            from agent_r1.distributed.group import end_rank

            end_rank(0)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"agent-r1 {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        stops = tuple(getattr(sys.modules[m], name) for m, name in STOPS if m in sys.modules)
        if not isinstance(exc, stops):
            raise
        print(f"agent-r1 {ns.command}: stopped: {exc}", file=sys.stderr)  # checkpoints are whole (resume=true)
        return 1
    return 0


def parse(name: str, args: list[str]) -> typing.Any:
    """The command's typed config from its arguments (`CONFIG.yaml`, `key=value`, `--key value`), every key
    and task option checked, nothing run: what `main` runs, and how tests/test_docs.py checks each command
    line the docs show."""
    cls, _ = command(name)
    args = flags_to_overrides(cls, args)
    paths = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if (key := POSITIONAL.get(name)) and paths and not paths[0].endswith((".yaml", ".yml")):
        overrides.insert(0, f"{key}={json.dumps(paths.pop(0))}")
    if name == "demo" and not paths:  # `agent-r1 demo` alone is `make demo`, from any directory
        paths = [str(RECIPES / "demo.yaml")]
    if len(paths) > 1:
        raise ConfigError(f"give at most one config file, got {', '.join(paths)}")
    return load_config(cls, paths[0] if paths else None, overrides)


def command(name: str) -> tuple[type, typing.Callable]:
    """A command's config class and function, its module imported now."""
    module, config, function, _ = COMMANDS[name]
    loaded = importlib.import_module(module)
    return getattr(loaded, config), getattr(loaded, function)


def quiet_third_party(quiet: bool) -> None:
    """Hide (or show again) the progress bars of transformers ("Loading weights", "Writing model shards",
    GGUF de-quantizing) and of huggingface_hub: our commands show their own progress."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    if quiet:
        hf_logging.disable_progress_bar()
        hub.disable_progress_bars()
    else:
        hf_logging.enable_progress_bar()
        hub.enable_progress_bars()


def log_to_terminal() -> None:
    """The library's messages (`logging.getLogger("agent_r1...")`: a kernel being compiled, a memory budget
    capped, a tool skipped) on stderr through rich, from INFO up. The library itself installs no handler, so a
    program that embeds agent-r1 filters them as it filters any logger's."""
    import logging

    from rich.console import Console
    from rich.logging import RichHandler

    logger = logging.getLogger("agent_r1")
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        logger.addHandler(RichHandler(console=Console(stderr=True), show_time=False, show_path=False, markup=False))
        logger.setLevel(logging.INFO)


def flags_to_overrides(cls: type, args: list[str]) -> list[str]:
    """`--key value`, `--key=value` and a bare boolean `--flag` -> `key=value`. Values of string keys
    are quoted, so a prompt such as "Compute: 6*7" stays a string instead of being read as YAML."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    rest = iter(args)
    for arg in rest:
        if not arg.startswith("--") or arg == "--help":
            out.append(arg)
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        kind = hints.get(key)
        if not eq:
            value = "true" if kind is bool else next(rest, "")
        literal = kind in (str, str | None) and not eq  # `--key=value` keeps YAML parsing
        out.append(f"{key}={json.dumps(value, ensure_ascii=False) if literal else value}")
    return out


if __name__ == "__main__":
    sys.exit(main())
