"""`ToolEnv`: a multi-turn environment where the model calls tools until it answers.

Each step parses the tool calls of the response (in the model family's syntax: `tool_formats`), runs
them concurrently, and returns the next prompt as token ids: by default the previous prompt + the
sampled ids + the tokenized tool results (so steps merge into one training row), or, when a `rewrite`
function is given, a freshly rendered context the task chose (summarised, truncated, ...). The episode
ends when the model answers (an `<answer>` tag, or a turn with no tool call) or when the turn budget
runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from agent_r1.env.base import Env, StepResult
from agent_r1.env.context import ContextConfig, ContextOverflow, ManagedContext, note_tool
from agent_r1.env.prompt_format import PromptFormat
from agent_r1.env.tool_calls import (
    CALL_OPEN,
    ParsedCall,
    ParseError,
    extract_answer,
    format_tool_responses,
    parse_tool_calls,
)
from agent_r1.env.tool_formats import tools_prompt
from agent_r1.models.vision import text_only
from agent_r1.tools import Tool, execute_tool_call
from agent_r1.types import Action, Message, Observation, Termination

_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)  # format_tool_responses' blocks
# tool-call errors that are the model's mistake (not a tool's or a backend's failure): `call_error_reward`
MODEL_ERRORS = frozenset({"parse_error", "unknown_tool", "invalid_arguments"})

# (task, final response text) -> outcome reward, or (reward, {name: value}) to log its parts;
# with reward_on="episode" the second argument is every response of the episode, in order
RewardFn = Callable[[dict[str, Any], Any], float | tuple[float, dict[str, float]]]
Rewrite = Callable[[list[Message]], list[Message]]  # full message history -> the next context
# (task, every tool result of the episode so far) -> potential Phi of the state, for process rewards
Potential = Callable[[dict[str, Any], list[dict[str, Any]]], float]


class ToolEnv(Env):
    """Tool calling over any prompt format, in the model family's syntax; one instance per episode."""

    def __init__(
        self,
        tools: Mapping[str, Tool],
        prompt_format: PromptFormat,
        reward_fn: RewardFn | None = None,
        *,
        instructions: str = "",
        examples: list[Message] | None = None,
        max_turns: int = 4,
        rewrite: Rewrite | None = None,
        max_tool_tokens: int | None = None,
        reward_on: Literal["final", "episode"] = "final",
        potential: Potential | None = None,
        call_error_reward: float = 0.0,
        max_images: int = 8,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_tool_tokens is not None and max_tool_tokens < 1:
            raise ValueError(f"max_tool_tokens must be >= 1, got {max_tool_tokens}")
        self.calls = prompt_format.tool_format  # the syntax the model writes its calls in
        self.base_format = prompt_format
        self.instructions = instructions
        self._set_tools(tools)
        self.reward_fn = reward_fn
        self.examples = list(examples or [])
        self.max_turns = max_turns
        self.rewrite = rewrite
        self.max_tool_tokens = max_tool_tokens  # each tool output is cut to this many tokens (None: no cut)
        self.reward_on = reward_on  # the reward sees the final response, or every response of the episode
        self.potential = potential  # process reward of a tool step: Phi(after) - Phi(before)
        # process reward per call the model got wrong (MODEL_ERRORS): negative charges for a call that did
        # nothing, which a per-turn format reward would otherwise pay for
        self.call_error_reward = call_error_reward
        self.max_images = max_images  # images one context may hold (a VLM's limit): more become a note
        self.stop = (*self.calls.stop, *prompt_format.stop)
        self.context_cfg: ContextConfig | None = None  # `manage`: a budget and a strategy (env/context.py)
        self.managed: ManagedContext | None = None  # the episode's managed context, made by reset

    def _set_tools(self, tools: Mapping[str, Tool]) -> None:
        """The tools and what depends on them: a template that renders tools itself gets them through
        apply_chat_template(tools=...), and the results as "tool" messages; otherwise our hermes-style
        system prompt and <tool_response> turns."""
        self.tools = dict(tools)
        self.schemas = {name: t.schema for name, t in self.tools.items()}
        listed = list(self.schemas.values())
        self.native = bool(self.base_format.native_tools and listed)
        self.format = self.base_format.with_tools(listed) if self.native else self.base_format
        self.system = self.instructions
        if listed and not self.native:
            self.system = tools_prompt(listed, self.instructions, self.calls)

    def manage(self, cfg: ContextConfig) -> ToolEnv:
        """Keep every episode's context within `cfg.budget` by `cfg.strategy` (env/context.py); the memory
        strategy adds its `note` tool. Called before the first `reset`."""
        if cfg.managed:
            if self.rewrite is not None:
                raise ValueError("task.context cannot manage an env that rewrites its own context")
            self.context_cfg = cfg
            if cfg.strategy == "memory":
                self._set_tools({**self.tools, "note": note_tool(lambda text: self.managed.note(text))})
        return self

    @property
    def prompt_prefix(self) -> list[Message]:
        """What every episode's prompt starts with: system (tools + instructions) and examples.
        SFT demonstrations use it too, so cold start and RL see the same prompt."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.in_model_format(self.examples)]

    def in_model_format(self, messages: list[Message]) -> list[Message]:
        """Messages written as tasks write demonstrations and examples (hermes `<tool_call>` blocks in the
        assistant's text, results as a user turn of `<tool_response>` blocks), in the form this env's
        model is trained on: its family's call syntax (`ToolFormat.write_turn`), and results as "tool"
        messages where its template renders them. Unchanged for hermes without native tools."""
        if self.calls.name == "hermes" and not self.native:
            return list(messages)
        out: list[Message] = []
        names: list[str] = []  # the calls of the last assistant turn
        for m in messages:
            content = m.get("content")
            outputs = _RESPONSE.findall(content) if m["role"] == "user" and isinstance(content, str) else []
            if m["role"] == "assistant" and isinstance(content, str) and CALL_OPEN in content:
                calls = [(c.name, c.arguments) for c in parse_tool_calls(content) if isinstance(c, ParsedCall)]
                names = [name for name, _ in calls]
                if self.calls.name != "hermes":
                    prose = content[: content.index(CALL_OPEN)].strip()
                    m = {**m, "content": self.calls.write_turn(prose, calls)}
                out.append(m)
            elif self.native and names and len(outputs) == len(names):
                out += self._tool_messages(names, outputs, turn=len(out))
                names = []
            else:
                out.append(m)
        return out

    async def reset(self, task: dict[str, Any]) -> Observation:
        """First prompt: system (tools) + few-shot examples + the task's question or messages."""
        self.task = task
        self.turn = 0
        self.responses: list[str] = []  # every response of this episode, in order
        self.tool_results: list[dict[str, Any]] = []  # every tool call's result of this episode, in order
        question = task.get("messages") or [{"role": "user", "content": str(task["question"])}]
        self.messages: list[Message] = [*self.prompt_prefix, *question]
        self.context = self.format.initial(self.messages)  # [T] ids the policy sees next
        self.images = self.format.images(self.messages)  # the images of the context, in placeholder order
        if len(self.images) > self.max_images:
            raise ValueError(f"the task's prompt has {len(self.images)} images, more than max_images={self.max_images}")
        self.start = len(self.messages)  # where the episode's own turns begin
        if self.context_cfg is not None:
            self.managed = ManagedContext(self.context_cfg, self.format, self.messages)
        return self._observation()

    def _observation(self) -> Observation:
        return Observation(token_ids=list(self.context), state=self._state(), images=list(self.images))

    async def step(self, action: Action) -> StepResult:
        if self.managed is not None and self.managed.awaiting_summary:
            return self._summary_step(action)
        self.turn += 1
        self.responses.append(action.text)
        self.messages.append({"role": "assistant", "content": action.text})
        parsed = self.calls.parse(action.text, self.schemas)
        # an answer tag, or a base model starting the next user turn ("\nUser:"), ends the episode
        answered = extract_answer(action.text) is not None or any(action.text.endswith(s) for s in self.format.stop)
        info: dict[str, Any] = {
            "tool_calls": 0,
            "format_errors": 0,
            "tool_errors": {},
            "truncated_outputs": 0,
        }
        if answered or not parsed:
            info["termination"] = Termination.ANSWERED
            return StepResult(None, self._outcome(action.text, info), True, info)
        if self.turn >= self.max_turns:
            info["termination"] = Termination.MAX_TURNS
            return StepResult(None, 0.0, True, info)

        outputs, shown, rewards, errors = await self._run_calls(parsed, info)
        info["tool_calls"] = sum(1 for p in parsed if not isinstance(p, ParseError))
        info["format_errors"] = sum(1 for p in parsed if isinstance(p, ParseError))
        info["tool_errors"] = dict(errors)
        try:
            self._extend(action, self._results_turn(parsed, outputs, shown), info)
        except ContextOverflow:
            info["termination"] = Termination.CONTEXT_OVERFLOW
            return StepResult(None, 0.0, True, info)
        reward = sum(rewards) if rewards else None  # process reward from the tools, if any gave one
        before = self.potential(self.task, self.tool_results) if self.potential else 0.0
        self.tool_results.extend(info.get("tool_results", []))
        if self.potential is not None:  # potential-based shaping (Ng et al. 1999): F = Phi(s') - Phi(s)
            reward = (reward or 0.0) + self.potential(self.task, self.tool_results) - before
        mistakes = sum(n for kind, n in errors.items() if kind in MODEL_ERRORS)
        if self.call_error_reward and mistakes:
            reward = (reward or 0.0) + self.call_error_reward * mistakes
        return StepResult(self._observation(), reward, False, info)

    def reply(self, action: Action, turn: list[Message], info: dict[str, Any] | None = None) -> Observation:
        """The next observation after a response the composing env handled itself (a message to a
        simulated user, say): the response, then `turn` (the user's reply), in the context as a tool
        results turn would be; counted against `max_turns` like any step. `info` (the step's) gets what
        a managed context did."""
        self.turn += 1
        self.responses.append(action.text)
        self.messages.append({"role": "assistant", "content": action.text})
        self._extend(action, turn, info)
        return self._observation()

    def _extend(self, action: Action, turn: list[Message], info: dict[str, Any] | None = None) -> None:
        """Put the sampled ids and the env's next `turn` into the context: appended token for token
        (steps merge into one training row), or a fresh context the task's `rewrite` or the managed
        context's strategy chose. A managed `append` context past its budget raises ContextOverflow."""
        response = self.messages[-1]
        self.messages.extend(turn)
        rewritten: list[Message] | None = None
        if self.rewrite is not None:
            rewritten = self.rewrite(list(self.messages))
        else:
            after_eos = action.finish_reason == "eos"
            appended = self.context + action.token_ids + self.format.continuation(turn, after_eos=after_eos)
            if self.managed is not None:
                rewritten = self.managed.after_turn([response, *turn], len(appended), len(self.context))
            if rewritten is None:
                self.context = appended
                self.images += self.format.images(turn)
        if rewritten is not None:
            self.context, self.images = self.format.initial(rewritten), self.format.images(rewritten)
        self._context_info(info, rewritten is not None)

    def _summary_step(self, action: Action) -> StepResult:
        """The model's answer to the summary request (the summarize strategy): the context restarts from
        the head and that summary. A summary step is not a turn of the task; an empty, too long or
        tool-calling one earns -summary_penalty."""
        assert self.managed is not None and self.context_cfg is not None
        self.messages.append({"role": "assistant", "content": action.text})
        info: dict[str, Any] = {"tool_calls": 0, "format_errors": 0, "tool_errors": {}, "truncated_outputs": 0}
        try:
            rewritten, problems = self.managed.take_summary(action.text)
        except ContextOverflow:
            info["termination"] = Termination.CONTEXT_OVERFLOW
            return StepResult(None, 0.0, True, info)
        self.context, self.images = self.format.initial(rewritten), self.format.images(rewritten)
        info["summary_problems"] = problems
        self._context_info(info, True, summaries=1.0, bad_summaries=float(bool(problems)))
        reward = -self.context_cfg.summary_penalty if problems else None
        return StepResult(self._observation(), reward, False, info)

    def _context_info(self, info: dict[str, Any] | None, rewritten: bool, **counts: float) -> None:
        """The managed context in the step's record (the viewer) and its counts in the episode's metrics."""
        if info is None or self.managed is None:
            return
        info["context"] = {**self.managed.info(), "rewritten": rewritten, "tokens": len(self.context)}
        metrics = {"rewrites": float(rewritten), **counts}
        info["metrics"] = {f"context/{k}": v for k, v in metrics.items()}

    def _results_turn(self, parsed: list, outputs: list[str], shown: list[list[Any]]) -> list[Message]:
        """The results as the template expects them: a "tool" message per call where it renders tools
        itself (ids of 9 letters and digits, as Mistral's templates require), else one user turn of
        <tool_response> blocks (also for images, which "tool" messages do not carry everywhere)."""
        if not self.native or any(shown):
            return [{"role": "user", "content": format_tool_responses(outputs, shown)}]
        names = [p.name if isinstance(p, ParsedCall) else "error" for p in parsed]
        return self._tool_messages(names, outputs, self.turn)

    @staticmethod
    def _tool_messages(names: list[str], outputs: list[str], turn: int) -> list[Message]:
        return [
            {"role": "tool", "name": name, "tool_call_id": f"c{turn:04d}{i:04d}", "content": out}
            for i, (name, out) in enumerate(zip(names, outputs, strict=True))
        ]

    def _state(self) -> str:
        """The env's state for GiGPO's step groups: a digest of every tool response shown so far (the
        task is the group's own), without the agent's thoughts and call syntax; images by their digest."""
        shown = [text_only(m)["content"] for m in self.messages[self.start :] if m["role"] != "assistant"]
        shown += [image.digest for image in self.images]
        if self.managed is not None:  # what a managed context carries: a summary step moves the state on
            shown += [self.managed.summary, *self.managed.notes, self.managed.awaiting_summary]
        return hashlib.sha1(json.dumps(shown).encode()).hexdigest()[:16]

    async def _run_calls(self, parsed: list, info: dict) -> tuple[list[str], list[list[Any]], list[float], Counter]:
        """Run every well-formed call concurrently; malformed ones become error observations. Returns
        each response's text and the images it shows, the tools' rewards and the error kinds."""
        results = await asyncio.gather(
            *(execute_tool_call(self.tools, p.name, p.arguments) for p in parsed if not isinstance(p, ParseError))
        )
        it = iter(results)
        outputs: list[str] = []
        shown: list[list[Any]] = []
        errors: Counter = Counter()
        room = self.max_images - len(self.images)
        for p in parsed:
            if isinstance(p, ParseError):
                outputs.append(f"Error: {p.message}")
                shown.append([])
                errors["parse_error"] += 1
                continue
            r = next(it)
            output, cut = r.output, False
            if self.max_tool_tokens is not None:
                output, cut = truncate_to_tokens(output, self.format.tokenizer, self.max_tool_tokens)
            kept, notes = self._take_images(r.images, room, errors)
            room -= len(kept)
            outputs.append(output + "".join(f"\n{n}" for n in notes))
            shown.append(kept)
            if r.error:
                errors[r.error] += 1
            info["truncated_outputs"] += r.truncated or cut
        info["tool_results"] = [
            {"name": r.name, "arguments": r.arguments, "output": r.output, "error": r.error, "images": len(r.images)}
            for r in results
        ]
        return outputs, shown, [r.reward for r in results if r.reward is not None], errors

    def _take_images(self, sources: list[Any], room: int, errors: Counter) -> tuple[list[Any], list[str]]:
        """The images of one tool result that the context takes, and a note for each one it does not: an
        image that cannot be read (bad_image) or one past `max_images` (too_many_images). The model
        reads the note; the run goes on."""
        kept, notes = [], []
        for source in sources:
            try:
                self.format.images([{"role": "user", "content": [{"type": "image", "image": source}]}])
            except ValueError as exc:
                errors["bad_image"] += 1
                notes.append(f"[the tool returned an image that cannot be shown: {exc}]")
                continue
            if len(kept) >= room:
                errors["too_many_images"] += 1
                notes.append(f"[an image was left out: a context holds at most {self.max_images} images]")
                continue
            kept.append(source)
        return kept, notes

    async def close(self) -> None:
        """End of the episode: free what its tools hold (a `python` sandbox's process and scratch
        directory). A failing close is not the episode's problem, so it is swallowed."""
        for t in self.tools.values():
            if t.close is not None:
                with contextlib.suppress(Exception):
                    await t.close()

    def _outcome(self, text: str, info: dict[str, Any]) -> float | None:
        """Outcome reward of the final response (cut at a format stop string such as "\nUser:")."""
        if self.reward_fn is None:
            return None
        for stop in self.format.stop:  # a base model that started writing the next turn
            text = text.split(stop)[0]
        if self.reward_on == "episode":
            result = self.reward_fn(self.task, [*self.responses[:-1], text])
        else:
            result = self.reward_fn(self.task, text)
        value, parts = result if isinstance(result, tuple) else (result, {})
        info["reward_parts"] = dict(parts)
        return float(value)


def truncate_to_tokens(text: str, tokenizer: PreTrainedTokenizerBase, max_tokens: int) -> tuple[str, bool]:
    """`text` cut to its first `max_tokens` tokens (plus a marker), and whether it was cut.

    Tool outputs are cut by tokens, not characters, so a turn's share of the context budget is exact."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens]) + " ...[truncated]", True
