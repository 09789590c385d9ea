"""Gateway task: train an agent program you already have, written with the OpenAI SDK or a framework on it.

    agent-r1 train task=gateway task.command="python my_agent.py" task.reward=my_rewards:score \
        task.data=tasks.jsonl

Each episode runs the program once (agent_r1/gateway/env.py: ProgramEnv) with `OPENAI_BASE_URL` and
`OPENAI_API_KEY` pointing at this episode of the gateway, and the task as one JSON line on its stdin (and
in `AGENT_R1_TASK`). Every chat request it makes is one step; the reward is `task.reward`'s, or the one
the program posts. The turn cap is `rollout.max_turns`, as for every task. docs/agents.md has the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent_r1.data import load_tasks
from agent_r1.data.splits import Split
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.gateway.env import ProgramEnv, import_path


@dataclass
class Options:
    command: str | tuple[str, ...] | None = None
    """the agent program, run once per episode: a command line ("python agent.py") or a list of arguments"""
    function: str | None = None
    """instead of command: pkg.module:function, called as function(task, base_url, api_key) in a thread"""
    reward: str | None = None
    """pkg.module:function, called as function(task, episode, output) when the program exits; none = the
    reward the program posts to the gateway (0 if it posts none)"""
    data: str | None = None
    """jsonl of tasks, one JSON object per line (any keys), used whole for every split"""
    timeout_s: float = 60.0
    """seconds the program may take, from its start and from each answer, to its next request or its exit"""
    pass_env: tuple[str, ...] = ()
    """names of the trainer's environment variables the program may inherit (beyond PATH, HOME, the locale
    and the like): nothing else of the trainer's environment reaches it"""
    max_reward: float = 100.0
    """a reward the program posts must lie in [-max_reward, max_reward]; one outside is refused (400)"""
    task_fields: tuple[str, ...] = ("question",)
    """the task's fields the program is given (stdin, AGENT_R1_TASK, a function's task, `{field}` in the
    command's arguments); the reward function gets them all, so the answer need not reach the program"""
    scratch: bool = False
    """run each episode's command in a fresh directory of its own (its working directory and HOME), removed
    when the episode ends; the reward function finds it in output.workdir"""
    prepare: str | None = None
    """pkg.module:function, called as function(task, directory) to fill the scratch directory before the
    program starts (a repository to work on); needs scratch=true"""

    def __post_init__(self) -> None:
        if self.command is not None and self.function is not None:
            raise ValueError("task.command and task.function both name the agent program: give one")
        if self.command in ("", ()):
            raise ValueError("task.command is empty")
        if not self.timeout_s > 0:
            raise ValueError(f"task.timeout_s must be > 0, got {self.timeout_s}")
        if not self.max_reward > 0:
            raise ValueError(f"task.max_reward must be > 0, got {self.max_reward}")
        if self.prepare is not None and not self.scratch:
            raise ValueError("task.prepare fills the episode's scratch directory: set task.scratch=true")
        for key, path in (
            ("task.function", self.function),
            ("task.reward", self.reward),
            ("task.prepare", self.prepare),
        ):
            if path is not None:
                import_path(path, key)  # a typo fails at start, not in the first episode


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` rows of `options.data` (the same file for every split)."""
    if not options.data:
        raise ValueError("task=gateway needs task.data: a jsonl file of tasks, one JSON object per line")
    return load_tasks(options.data, required=())[:n]


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 8) -> ProgramEnv:
    """The program as an env for one episode."""
    if options.command is None and options.function is None:
        raise ValueError("task=gateway needs task.command (the agent program to run) or task.function")
    program = options.command if options.command is not None else import_path(options.function, "task.function")
    reward = import_path(options.reward, "task.reward") if options.reward else None
    return ProgramEnv(
        program, prompt_format, reward, timeout_s=options.timeout_s, max_turns=max_turns,
        pass_env=options.pass_env, max_reward=options.max_reward, task_fields=options.task_fields,
        scratch=options.scratch, prepare=import_path(options.prepare, "task.prepare") if options.prepare else None,
    )  # fmt: skip
