"""Tasks are plugins: one module (or object) brings the tasks, the env, the reward and its own options.

A task provides, as attributes of a module (`task=my_pkg.my_task`, `task=path/to/file.py`) or of an
object (`task=my_pkg.my_task:TASK`):

    Options                                   a dataclass of the task's options, each with a docstring;
                                              set as `task.KEY=VALUE` (unknown keys are errors)
    tasks(options, split, n, seed)            the first `n` tasks (dicts) of split "train" | "val" | "test"
    make_env(options, prompt_format, max_turns)   a fresh env (env.base.Env) for one episode; the reward lives in it
    demos(options, env, n, seed)              optional: SFT demonstrations (chat messages, see trainer/sft.py)
    KIND_KEY                                  optional: the task field that names a kind of problem, for
                                              a per-kind accuracy in eval (the calculator's "ops")
    SLOW_STEPS                                optional, True: an env step waits seconds on another model or
                                              a service (τ²'s customer), so rollouts do not batch in lockstep
                                              (agent_loop.AgentEnvLoop.run)

The built-in tasks live in `agent_r1/tasks/` and are found by name (`task=calculator`). Nothing in the
library imports a task module: entry points resolve the name here, at run time, so adding a task is
one file and no edit to `agent_r1/` (examples/ has one).

`EnvFactory` is what the rollout loop calls per episode. It is a plain dataclass of picklable parts
(task name, options, tokenizer, prompt kind, turn budget), so it can be shipped to another process
(a Ray worker, a torchrun rank) and rebuilt there; heavy state such as a search index is created
lazily by the task on first use, in the process that needs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_r1.config import build
from agent_r1.data import Split
from agent_r1.env.base import Env
from agent_r1.env.context import ContextConfig
from agent_r1.env.prompt_format import prompt_format_for

BUILTIN_TASKS = (
    "bfcl", "calculator", "coding", "digits", "dossiers", "gateway", "gsm8k", "hotpotqa", "openenv", "reasoning_gym",
    "tau2",
)  # fmt: skip
REQUIRED = ("Options", "tasks", "make_env")


def load_task(name: str) -> Any:
    """The task module or object named by a built-in name, an import path (`pkg.mod` or `pkg.mod:obj`)
    or a .py file. A name that resolves to nothing usable is a one-line ValueError."""
    target = f"agent_r1.tasks.{name}" if name in BUILTIN_TASKS else name
    module_name, _, attr = target.partition(":")
    if not module_name or module_name.startswith("."):  # import_module raises TypeError on a relative name
        raise _cannot_import(name, "not an absolute import path")
    if "" not in sys.path and os.getcwd() not in sys.path:  # `task=my_pkg.my_task` from the project root,
        sys.path.append(os.getcwd())  # as `python -m` would find it (the agent-r1 script does not add it)
    try:
        module = _load_file(Path(module_name)) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing and not module_name.startswith(missing) and not module_name.endswith(".py"):
            raise  # the task exists but imports something missing: show the real error
        raise _cannot_import(name, exc) from None
    if attr and not hasattr(module, attr):
        raise ValueError(f"task {name!r}: {module_name} has no attribute {attr!r}")
    task = getattr(module, attr) if attr else module
    missing = [a for a in REQUIRED if not hasattr(task, a)]
    if missing:
        raise ValueError(f"task {name!r} lacks {', '.join(missing)} (a task provides {', '.join(REQUIRED)})")
    if not dataclasses.is_dataclass(task.Options):
        raise ValueError(f"task {name!r}: Options must be a dataclass")
    return task


def _cannot_import(name: str, why: object) -> ValueError:
    return ValueError(
        f"task {name!r} cannot be imported ({why}); built-in tasks: {', '.join(BUILTIN_TASKS)}, "
        "or give an import path such as my_pkg.my_task"
    )


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise ImportError(f"no file {path}")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    module_name = f"agent_r1_task_{path.stem}_{digest}"  # two files of the same name stay two tasks
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses (and pickle) look the module up by name
    spec.loader.exec_module(module)
    return module


@dataclass
class TaskSpec:
    """A task and its options, as one config section: `task=NAME` plus `task.KEY=VALUE` for options."""

    name: str = "calculator"
    options: Any = None  # the task's Options instance (its defaults when None)
    context: ContextConfig = dataclasses.field(default_factory=ContextConfig)  # `task.context.*`: env/context.py

    def __post_init__(self) -> None:
        if self.name.endswith(".py"):  # a file task is the same task from any working directory
            self.name = str(Path(self.name).resolve())
        if self.options is None:
            self.options = self.module.Options()

    @property
    def module(self) -> Any:
        return load_task(self.name)

    def with_options(self, changes: dict[str, Any], prefix: str = "task.") -> TaskSpec:
        """The same task with some options replaced (validation's own `ops`, say), checked like config keys."""
        raw = dataclasses.asdict(self.options) | changes
        return TaskSpec(self.name, build(type(self.options), raw, prefix=prefix), self.context)

    def tasks(self, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """The first `n` tasks of one split."""
        return self.module.tasks(self.options, split, n, seed)

    def env_factory(self, tokenizer: Any, chat: bool, max_turns: int, tool_format: str = "auto") -> EnvFactory:
        return EnvFactory(self.name, self.options, tokenizer, chat, max_turns, tool_format, self.context)

    @property
    def kind_key(self) -> str | None:
        return getattr(self.module, "KIND_KEY", None)

    # -- the config hooks agent_r1.config calls: `task: NAME` or `task: {name: NAME, KEY: VALUE}` ----------

    @classmethod
    def from_raw(cls, value: Any, key: str, default: TaskSpec) -> TaskSpec:
        """Build from YAML/overrides; options are checked against the task's Options by `build`."""
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, dict):
            raise ValueError(f"config key '{key}' must be a task name or a section, got {value!r}")
        value = dict(value)
        name = str(value.pop("name", default.name))
        context = value.pop("context", {})
        if not isinstance(context, dict):
            raise ValueError(f"config key '{key}.context' must be a section, got {context!r}")
        options_cls = load_task(name).Options
        base = dataclasses.asdict(default.options) if name == default.name else {}
        context = build(ContextConfig, dataclasses.asdict(default.context) | context, prefix=f"{key}.context.")
        return cls(name, build(options_cls, base | value, prefix=f"{key}."), context)

    def to_raw(self) -> dict[str, Any]:
        """The section as YAML writes it; `context` only when it is managed (the default is append-only)."""
        context = {"context": dataclasses.asdict(self.context)} if self.context.managed else {}
        return {"name": self.name, **dataclasses.asdict(self.options), **context}


@dataclass(frozen=True)
class EnvFactory:
    """`make_env()` for the rollout loop: builds the task's env for one episode. Picklable."""

    task: str
    options: Any
    tokenizer: Any
    chat: bool
    max_turns: int
    tool_format: str = "auto"  # the tool-call family (agent_r1.env.tool_formats): auto = the template's
    context: ContextConfig = dataclasses.field(default_factory=ContextConfig)

    @property
    def slow_steps(self) -> bool:
        """The task's `SLOW_STEPS`: its env steps take seconds (a model call), not milliseconds."""
        return bool(getattr(load_task(self.task), "SLOW_STEPS", False))

    def __call__(self) -> Env:
        fmt = prompt_format_for(self.tokenizer, chat=self.chat, tool_format_name=self.tool_format)
        env = load_task(self.task).make_env(self.options, fmt, self.max_turns)
        if not self.context.managed:
            return env
        if not callable(getattr(type(env), "manage", None)):  # a ToolEnv, or τ²'s, which manages its ToolEnv
            raise ValueError(
                f"task.context needs an env that manages its context (a ToolEnv, τ²); task {self.task!r} "
                f"makes a {type(env).__name__}"
            )
        return env.manage(self.context)

    def check_context(self, task: dict[str, Any]) -> None:
        """Under `task.context`, start one episode of `task` before any rollout: a budget that cannot hold
        the system prompt and the task fails here in one line, not in every episode."""
        if not self.context.managed:
            return
        env = self()

        async def start() -> None:
            try:
                await env.reset(task)
            finally:
                await env.close()

        asyncio.run(start())

    def __reduce__(self) -> tuple:
        """Pickled with the options as a plain dict, rebuilt from the task's own Options on the other side:
        a task loaded from a file has no importable module name in a fresh process, so its Options class
        cannot be pickled by reference."""
        options = dataclasses.asdict(self.options)
        return (
            _rebuild_factory,
            (self.task, options, self.tokenizer, self.chat, self.max_turns, self.tool_format, self.context),
        )


def _rebuild_factory(
    task: str,
    options: dict[str, Any],
    tokenizer: Any,
    chat: bool,
    max_turns: int,
    tool_format: str,
    context: ContextConfig | None = None,
) -> EnvFactory:
    options_ = build(load_task(task).Options, options, prefix="task.")
    return EnvFactory(task, options_, tokenizer, chat, max_turns, tool_format, context or ContextConfig())


def resolve_tool_format(tool_format: str, model_name: str | None) -> str:
    """The tool-call family asked for; for "auto", the one a policy directory was trained with (its
    agent_r1.json), else "auto" (the chat template's own, agent_r1.env.tool_formats)."""
    if tool_format != "auto" or model_name is None:
        return tool_format
    from agent_r1.models.loading import recorded_tool_format

    return recorded_tool_format(model_name)


def resolve_chat(prompt_format: str, tokenizer: Any, model_name: str | None = None) -> bool:
    """Chat template or plain text: `chat`/`text` as asked; `auto` = what the model was trained with
    (its agent_r1.json, when loaded by name), else whether its tokenizer has a chat template."""
    if prompt_format != "auto":
        return prompt_format == "chat"
    if model_name is not None:
        from agent_r1.models.loading import is_chat_model

        return is_chat_model(model_name, tokenizer)
    return bool(tokenizer.chat_template)
