"""`agent-r1 chat`: talk to a model that uses tools, in the terminal or for one prompt.

Each user message runs the same agent loop as training (`AgentEnvLoop` over a `ToolEnv` with the
chosen tools), so what you see is what the policy does in rollouts: its prose streams token by token,
and each tool call and tool result is shown in its own panel as it happens. The conversation (tool
calls and results included) is kept as history for the next message. `--prompt` runs one message
and prints only the final answer, or with `--json` the whole trajectory (exact ids and log-probs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from agent_r1.engines import EngineKind, EngineSpec, VLLMConfig, load_for_engine, make_engine
from agent_r1.engines.protocol import Engine, GenerateOutput, SamplingParams
from agent_r1.env.base import Env, StepResult
from agent_r1.env.prompt_format import PromptFormat, prompt_format_for
from agent_r1.env.tool_calls import CALL_OPEN, extract_answer
from agent_r1.env.tool_env import ToolEnv
from agent_r1.env.tool_formats import ToolFormatName
from agent_r1.models.loading import EXPORT_INFO, eos_token_ids, load_processor
from agent_r1.models.precision import Device, Precision
from agent_r1.models.vision import read_image
from agent_r1.rollout.agent_loop import AgentEnvLoop
from agent_r1.rollout.text_stream import TextStream, visible_prefix
from agent_r1.task import TaskSpec, resolve_chat, resolve_tool_format
from agent_r1.tools import BUILTIN_TOOLS, Tool
from agent_r1.types import Action, Message, Observation, Trajectory

COMMANDS = {
    "/image PATH": "show a picture with the next message",
    "/reset": "forget the conversation",
    "/tools": "list the tools",
    "/exit": "quit (or Ctrl-D)",
}


@dataclass
class ChatConfig:
    model: str = "default"
    """"default", a bundled model name, a Hugging Face directory or an `agent-r1 export` directory"""
    device: Device = "auto"
    """where the model runs: auto = cuda when a GPU is visible, else cpu"""
    dtype: Precision = "fp32"
    """weights and compute in fp32, or in bf16 (a GPU choice: half the memory)"""
    engine: EngineKind = "local"
    """what samples: local (the model in this process), vllm (vLLM in this process), or remote (an
    OpenAI-compatible server that speaks token ids at url; model then names the tokenizer, the server's)"""
    url: str = ""
    """engine=remote: the server's base URL (http://host:port)"""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """engine=vllm: vLLM's own settings"""
    task: str | None = None
    """the task whose tools, instructions and worked example the model sees (calculator, hotpotqa, an import
    path); None = the task recorded in the model's agent_r1.json (what it was trained on), if any"""
    tools: tuple[str, ...] = ()
    """more tools the model may call, comma-separated: calculator, echo (calculator when there is no task)"""
    prompt: str | None = None
    """answer this one message and exit, printing only the final answer (no terminal session)"""
    images: tuple[str, ...] = ()
    """with prompt: pictures (paths or data URLs; several as a list, '[a.png,b.png]': a data URL holds a comma)
    shown with the message, for a vision model"""
    json: bool = False
    """with prompt: print the whole trajectory and history as JSON instead of the answer"""
    system: str = ""
    """instructions put before the tool descriptions in the system prompt (replacing the task's)"""
    max_turns: int = 4
    """model turns per user message (each tool call costs one)"""
    max_new_tokens: int = 256
    """sampled tokens per model turn"""
    temperature: float = 0.0
    """0 = greedy"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    seed: int = 0
    """sampling seed"""
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    """chat template or plain text; auto = chat when the model has a template"""
    tool_format: ToolFormatName = "auto"
    """how the model writes tool calls: auto = its chat template's family (hermes, llama3_json, mistral,
    mistral_args, qwen3_coder, harmony); hermes for a model without a template"""

    def __post_init__(self) -> None:
        self.tools = tuple(t.strip() for item in self.tools for t in item.split(",") if t.strip())
        unknown = [t for t in self.tools if t not in BUILTIN_TOOLS]
        if unknown:
            hint = " (the search tool comes with --task hotpotqa)" if "search" in unknown else ""
            raise ValueError(f"unknown tool {unknown[0]!r}; available tools: {', '.join(BUILTIN_TOOLS)}{hint}")
        if self.json and self.prompt is None:
            raise ValueError("--json needs --prompt (it prints one trajectory)")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        _ = self.sampling  # validates temperature, top_p and max_new_tokens before the model loads
        self.engine_spec()  # an unknown engine, or remote without url: one line now

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)

    def engine_spec(self) -> EngineSpec:
        return EngineSpec(self.engine, self.url, seed=self.seed, dtype=self.dtype, vllm=self.vllm)


StepCallback = Callable[[Action, StepResult], None]


class ChatSession:
    """A conversation with a tool-using model: history + one agent-loop episode per user message."""

    def __init__(
        self,
        engine: Engine,
        prompt_format: PromptFormat,
        tools: Mapping[str, Tool],
        sampling: SamplingParams,
        *,
        instructions: str = "",
        examples: list[Message] | None = None,
        max_tool_tokens: int | None = None,
        max_turns: int = 4,
        seed: int | None = 0,
    ) -> None:
        self.engine = engine
        self.format = prompt_format
        self.tools = dict(tools)
        self.sampling = sampling
        self.instructions = instructions
        self.examples = examples
        self.max_tool_tokens = max_tool_tokens
        self.max_turns = max_turns
        self.seed = seed
        self.history: list[Message] = []  # user, assistant (tool calls included) and tool-result turns

    def make_env(self) -> ToolEnv:
        """The env of one user message; its system prompt is what a model trained with these tools saw."""
        return ToolEnv(
            self.tools, self.format, instructions=self.instructions, examples=self.examples,
            max_turns=self.max_turns, max_tool_tokens=self.max_tool_tokens,
        )  # fmt: skip

    def reset(self) -> None:
        self.history = []

    async def send(
        self,
        text: str,
        on_token: Callable[[int], None] | None = None,
        on_step: StepCallback | None = None,
        images: tuple[Any, ...] = (),
    ) -> Trajectory:
        """Run the agent on the history + `text` (after `images`, for a vision model) until it answers;
        the history then holds the new turns."""
        envs: list[ToolEnv] = []

        def make_env() -> _WatchedEnv:
            envs.append(self.make_env())
            return _WatchedEnv(envs[-1], on_step)

        engine = _StreamingEngine(self.engine, on_token) if on_token else self.engine
        loop = AgentEnvLoop(engine, make_env, self.sampling, seed=self.seed)
        content: Any = text
        if images:
            content = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}]
        (traj,) = await loop.run([{"messages": [*self.history, {"role": "user", "content": content}]}])
        if envs and hasattr(envs[0], "messages"):
            self.history = envs[0].messages[len(envs[0].prompt_prefix) :]
        return traj

    def final_answer(self, traj: Trajectory) -> str:
        """The last turn's answer: its `<answer>` tag if it wrote one, else its prose."""
        if traj.error:
            return f"[error: {traj.error}]"
        text = traj.steps[-1].text if traj.steps else ""
        answer = extract_answer(text)
        return answer if answer is not None else visible_prefix(text, (CALL_OPEN, *self.format.stop), True).strip()


class _StreamingEngine:
    """The engine, reporting every sampled token of this session's single trajectory."""

    def __init__(self, engine: Engine, on_token: Callable[[int], None]) -> None:
        self.engine = engine
        self.max_context = engine.max_context
        self.on_token = on_token

    async def generate(self, prompts: list[list[int]], params: SamplingParams, **kw) -> list[GenerateOutput]:
        return await self.engine.generate(prompts, params, lambda _, token, __: self.on_token(token), **kw)  # type: ignore[call-arg]

    def cohort(self, size: int) -> contextlib.AbstractContextManager[Any]:
        return self.engine.cohort(size)


class _WatchedEnv(Env):
    """A `ToolEnv` that reports each step, so the terminal shows tool calls and results as they happen."""

    def __init__(self, env: ToolEnv, on_step: StepCallback | None) -> None:
        self.env = env
        self.stop = env.stop
        self.on_step = on_step

    async def reset(self, task: dict[str, Any]) -> Observation:
        return await self.env.reset(task)

    async def step(self, action: Action) -> StepResult:
        result = await self.env.step(action)
        if self.on_step is not None:
            self.on_step(action, result)
        return result

    async def close(self) -> None:
        await self.env.close()


class ChatPrompt(NamedTuple):
    """What the model sees around the conversation, as in training."""

    tools: dict[str, Tool]
    instructions: str
    examples: list[Message]
    max_tool_tokens: int | None  # each tool output cut to this many tokens, as the task's env does


def session_prompt(cfg: ChatConfig, tokenizer: Any, chat: bool) -> ChatPrompt:
    """The chat's tools, instructions, worked example and tool-output cut: the task's, as the policy saw
    them in training (the task named by --task, else the one recorded in the model's agent_r1.json, with
    the recorded options when the names match), plus --tools."""
    spec = _chat_task(cfg)
    if spec is None:
        return ChatPrompt({t: BUILTIN_TOOLS[t] for t in cfg.tools or ("calculator",)}, cfg.system, [], None)
    env = spec.env_factory(tokenizer, chat, cfg.max_turns, resolve_tool_format(cfg.tool_format, cfg.model))()
    if not isinstance(env, ToolEnv):
        raise ValueError(f"task {spec.name!r} does not use a ToolEnv: chat needs tools and a system prompt")
    tools = dict(env.tools) | {t: BUILTIN_TOOLS[t] for t in cfg.tools}
    return ChatPrompt(tools, cfg.system or env.instructions, env.examples, env.max_tool_tokens)


def _chat_task(cfg: ChatConfig) -> TaskSpec | None:
    info = Path(cfg.model).expanduser() / EXPORT_INFO
    recorded = json.loads(info.read_text()).get("task") if info.is_file() else None
    if recorded and cfg.task in (None, recorded["name"]):  # a chat keeps its whole history: no task.context
        recorded = {k: v for k, v in recorded.items() if k != "context"}
        return TaskSpec.from_raw(recorded, "task", TaskSpec(recorded["name"]))
    return TaskSpec(cfg.task) if cfg.task is not None else None


def run_chat(cfg: ChatConfig, console: Console | None = None) -> None:
    console = console or Console(highlight=False)
    model, tokenizer = load_for_engine(cfg.engine, cfg.model, cfg.device, cfg.dtype)
    processor = load_processor(cfg.model) or tokenizer  # a vision-language model reads images through it
    chat = resolve_chat(cfg.prompt_format, processor, cfg.model)
    prompt = session_prompt(cfg, processor, chat)
    engine = make_engine(cfg.engine_spec(), model, tokenizer)
    session = ChatSession(
        engine, prompt_format_for(processor, chat, resolve_tool_format(cfg.tool_format, cfg.model)), prompt.tools,
        cfg.sampling,
        instructions=prompt.instructions, examples=prompt.examples, max_tool_tokens=prompt.max_tool_tokens,
        max_turns=cfg.max_turns, seed=cfg.seed,
    )  # fmt: skip
    try:
        if cfg.prompt is None:
            _Terminal(session, console, cfg.model, tokenizer, eos_token_ids(model, tokenizer)).run()
            return
        traj = asyncio.run(session.send(cfg.prompt, images=cfg.images))
        if cfg.json:
            print(json.dumps({"history": session.history, "trajectory": dataclasses.asdict(traj)}, default=str))
        else:
            print(session.final_answer(traj))
    finally:
        engine.close()  # vLLM's workers and a remote engine's connections end with the chat


class _Terminal:
    """The interactive session: read a line, stream the agent's turns, repeat."""

    def __init__(
        self, session: ChatSession, console: Console, model_name: str, tokenizer: Any, eos_ids: set[int]
    ) -> None:
        self.session = session
        self.console = console
        self.model_name = model_name
        self.eos_ids = eos_ids  # sampled, never shown
        self.tokenizer = tokenizer
        self.text = self._new_stream()
        self.images: list[str] = []  # attached with /image, shown with the next message

    def run(self) -> None:
        tools = ", ".join(self.session.tools) or "none"
        self.console.print(f"[bold]agent-r1 chat[/] · {self.model_name} · tools: {tools}")
        self.console.print("[dim]" + "  ".join(f"{c} {h}" for c, h in COMMANDS.items()) + "[/]")
        with asyncio.Runner() as runner:
            while (line := self._read()) is not None:
                if line.startswith("/"):
                    if not self._command(line):
                        break
                elif line:
                    self._turn(runner, line)

    def _read(self) -> str | None:
        try:
            return self.console.input("\n[bold cyan]you ›[/] ").strip()
        except (EOFError, KeyboardInterrupt):
            return None

    def _command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        if line in ("/exit", "/quit"):
            return False
        if line == "/reset":
            self.session.reset()
            self.console.print("[dim]conversation cleared[/]")
        elif line.startswith("/image "):
            path = line.removeprefix("/image ").strip()
            try:
                read_image(path)
            except ValueError as exc:
                self.console.print(f"[red]{exc}[/]")
            else:
                self.images.append(path)
                self.console.print(f"[dim]{path} will be shown with your next message[/]")
        elif line == "/tools":
            table = Table("tool", "description", "arguments")
            for t in self.session.tools.values():
                table.add_row(t.name, t.description, ", ".join(t.parameters.get("properties", {})))
            self.console.print(table)
        else:
            self.console.print(f"[red]unknown command {line}[/]; commands: {', '.join(COMMANDS)}")
        return True

    def _turn(self, runner: asyncio.Runner, line: str) -> None:
        self.console.print("[bold magenta]agent ›[/] ", end="")
        self.text = self._new_stream()
        try:
            images, self.images = tuple(self.images), []
            traj = runner.run(self.session.send(line, self._on_token, self._on_step, images))
        except KeyboardInterrupt:  # Ctrl-C stops this answer (the engine drops the row), not the session
            self.console.print("\n[yellow]interrupted[/]")
            return
        if traj.error:
            self.console.print(f"\n[red]error: {traj.error}[/]")
        self.console.print()

    def _new_stream(self) -> TextStream:
        return TextStream(self.tokenizer, self.eos_ids, (CALL_OPEN, *self.session.format.stop))

    def _on_token(self, token: int) -> None:
        self._write(self.text.push(token))

    def _on_step(self, action: Action, result: StepResult) -> None:
        """End of a model turn: finish its prose, then show its tool calls and their results."""
        self._write(self.text.finish())
        info = result.info
        for call in info.get("tool_results", []):
            args = json.dumps(call["arguments"], ensure_ascii=False)
            self.console.print()
            self.console.print(Panel(args, title=f"tool call · {call['name']}", border_style="yellow", expand=False))
            style = "red" if call["error"] else "green"
            self.console.print(Panel(call["output"], title="tool result", border_style=style, expand=False))
        if info.get("format_errors"):
            self.console.print(Panel(action.text, title="malformed tool call", border_style="red", expand=False))
        if not result.done:
            self.console.print("[bold magenta]agent ›[/] ", end="")
        self.text = self._new_stream()

    def _write(self, delta: str) -> None:
        if delta:
            self.console.out(delta, end="", highlight=False)
            self.console.file.flush()
