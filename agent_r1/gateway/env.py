"""`ProgramEnv`: an agent program written against the OpenAI or Anthropic API, run unchanged as an agent-r1
environment.

`reset(task)` opens an episode on this process's gateway server (agent_r1/gateway/server.py) and starts
the program: a command line, with `OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL` and `OPENAI_API_KEY` /
`ANTHROPIC_API_KEY` set to the episode's routes and key and the task as JSON on its stdin (and in
`AGENT_R1_TASK`), or a Python function
`fn(task, base_url, api_key)` run in a thread. The program is given the task's `task_fields` only (by
default its question): the answer stays with the reward function, out of reach of model-written code.
The program's first request (chat completions, Messages or Responses: each is the chat request it means),
rendered with the model's chat template, is the first observation.
Each `step(action)` sends the sampled answer back as that request's chat.completion (content, and
`tool_calls` parsed from the hermes `<tool_call>` blocks) and waits for the program's next request (the
next observation) or its exit (the end of the episode, with the reward).

Token-exact across turns: when the next request repeats the previous one's messages and the answer the
gateway gave, the next prompt is the previous prompt + the sampled ids + the chat template's delta of
the new messages (tool results, user turns), exactly as `ToolEnv` builds it, so the steps merge into
one training row. A request whose history was rewritten (a turn dropped or edited, a summary) is
rendered afresh and starts a row of its own. Sampled ids are never decoded and re-tokenized as if
sampled. Every step records which it was (`gateway/merged_steps`, `gateway/fresh_steps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_r1.api import bodies
from agent_r1.api.http import off_loop
from agent_r1.api.messages import (
    answer_grammar,
    chat_result,
    check_unicode,
    forced_call,
    template_messages,
    tool_schemas,
)
from agent_r1.api.schema import APIError, ChatMessage
from agent_r1.env.base import Env, StepResult
from agent_r1.env.prompt_format import PromptFormat, prompt_format_for
from agent_r1.env.tool_calls import ParseError
from agent_r1.gateway.server import Call, Gateway, Mailbox, Unseen, gateway
from agent_r1.models.vision import image_parts
from agent_r1.types import Action, Observation, Termination
from agent_r1.utils.imports import import_path

# a command line (a string, split like a shell would) or its arguments, or fn(task, base_url, api_key)
Program = str | Sequence[str] | Callable[[dict[str, Any], str, str], Any]
STDOUT_KEPT = 2**20  # the program's stdout handed to the reward: its last MiB
STDERR_KEPT = 2**16  # its stderr: the last 64 KiB, whose end goes into the error of a failed episode
TASK_ENV_MAX = 2**16  # AGENT_R1_TASK is set when the task's JSON is at most this long (stdin always has it)
ERROR_TAIL = 360  # characters of stderr (or a function's traceback) in a failed episode's error
# what a command inherits from the trainer's environment unless the task passes more (`pass_env`): what
# programs need to run, never the trainer's tokens and credentials, which model-written code could read
ATTACHED = ("merged", "branched", "fresh")  # how a request attaches to the episode's tree (`_attach`)
INHERITED_ENV = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "PYTHONPATH",
    "VIRTUAL_ENV", "NODE_PATH",
)  # fmt: skip


class ProgramError(RuntimeError):
    """The agent program failed: it crashed, exited non-zero, timed out, or never called the model. The
    rollout loop ends the episode as `error` with this message; nothing is trained on it."""


@dataclass
class ProgramOutput:
    """What the program left behind, for the reward function."""

    exit_code: int  # the command's exit status; 0 for a function that returned
    stdout: str = ""  # the command's standard output (its last MiB); "" for a function
    value: Any = None  # the function's return value; None for a command
    reward: float | None = None  # the last reward the program posted to /episodes/{id}/reward
    workdir: str | None = None  # the episode's scratch directory (with `scratch`), still there for the reward


@dataclass
class Episode:
    """The episode as the gateway saw it, for the reward function (OpenAI-format messages)."""

    messages: list[dict[str, Any]]  # the program's last request and the gateway's last answer
    answers: list[dict[str, Any]]  # every answer the gateway gave, in order
    # per step (the trajectory's step index): the request it answered, its answer, and how the request attached
    # to the episode's tree ("fresh", "merged" or "branched"): a reward function scores branches from these
    steps: list[EpisodeStep] = field(default_factory=list)


@dataclass
class EpisodeStep:
    """One step of an episode: the request (its messages), the answer, and where it attached in the tree."""

    messages: list[dict[str, Any]]
    answer: dict[str, Any]
    attached: str


# (task, episode, output) -> outcome reward, or (reward, {name: value}) to log its parts, or (reward, parts,
# {step index: reward}) to score steps of their own (a sub-agent's branch, say): those become process rewards
RewardFn = Callable[
    [dict[str, Any], Episode, ProgramOutput],
    float | tuple[float, dict[str, float]] | tuple[float, dict[str, float], dict[int, float]],
]


@dataclass
class _Exit:
    """The program ended: its exit code, and for a function its return value or its exception."""

    code: int
    value: Any = None
    error: str = ""


class ProgramEnv(Env):
    """An agent program as an env, one instance per episode (the `Env` protocol of agent_r1/env/base.py)."""

    def __init__(
        self,
        program: Program,
        prompt_format: PromptFormat,
        reward: RewardFn | None = None,
        *,
        timeout_s: float = 60.0,
        max_turns: int = 8,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        pass_env: Sequence[str] = (),
        max_reward: float = 100.0,
        task_fields: Sequence[str] = ("question",),
        scratch: bool = False,
        prepare: Callable[[dict[str, Any], str], None] | None = None,
    ) -> None:
        """`env`: variables set for a command; `pass_env`: names of the trainer's own it may inherit beyond
        `INHERITED_ENV`; `max_reward`: a posted reward outside [-max_reward, max_reward] is refused (4xx);
        `task_fields`: the task's fields the program is given (the reward function gets them all), also as
        `{field}` in a command's arguments; `scratch`: a command runs in a fresh directory of its own (its
        working directory and HOME), removed when the episode ends; `prepare(task, directory)` fills that
        directory before the program starts (a coding task's repository)."""
        if prepare is not None and not scratch:
            raise ValueError("prepare fills the episode's scratch directory: it needs scratch=True")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(program, str):
            program = shlex.split(program)
        if not callable(program):
            program = [str(a) for a in program]
            if not program:
                raise ValueError("the agent program's command line is empty")
        self.program = program
        self.format = prompt_format
        self.reward_fn = reward
        self.timeout_s = timeout_s  # seconds the program may take to its next request or its exit
        self.max_turns = max_turns
        self.extra_env = dict(env or {})  # more environment variables for a command
        self.pass_env, self.task_fields = tuple(pass_env), tuple(task_fields)
        if not max_reward > 0:
            raise ValueError(f"max_reward must be > 0, got {max_reward}")
        self.max_reward = max_reward
        self.cwd, self.scratch, self.workdir, self.prepare = cwd, scratch, None, prepare
        self.stop: tuple[str, ...] = tuple(prompt_format.stop)  # the current request's (read before each turn)
        self.samples = 1  # the current request's `n`: the rollout loop samples this many answers
        self.mailbox: Mailbox | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task] = []
        self._stdout, self._stderr = bytearray(), bytearray()

    # --- the Env protocol ----------------------------------------------------------------------------
    async def reset(self, task: dict[str, Any]) -> Observation:
        """Start the program; its first chat request is the first observation."""
        self.task, self.turn = task, 0
        self.answers: list[dict[str, Any]] = []
        self.steps: list[EpisodeStep] = []  # each step's request, answer and attachment, for the reward function
        self.turns: list[_Turn] = []  # every request answered so far: the nodes a later request may attach to
        self.choice = 0  # which answer the program's history went on with
        self.call: Call | None = None  # the request the policy answers next
        self.answered: Call | None = None  # the request answered last
        self.unseen = False  # the answer to `answered` never reached the program
        self.attached = "fresh"  # how the current request attached: merged, branched or fresh
        self.gateway: Gateway = await asyncio.to_thread(gateway)  # started on first use
        self.mailbox = self.gateway.open()
        self.mailbox.max_reward, self.mailbox.count_tokens = self.max_reward, self._count_tokens
        self.base_url, self.api_key = self.gateway.base_url(self.mailbox), self.mailbox.token
        await self._start({k: task[k] for k in self.task_fields if k in task}, task)  # the answer stays with the reward
        event = await self._wait(render=True)
        if isinstance(event, _Exit):
            raise ProgramError(self._failure(event))
        return event

    async def step(self, action: Action) -> StepResult:
        """Answer the waiting request with the sampled response(s); then the program's next request, or its exit.
        With `n` > 1 the step is the answer the program went on with (info["choice"]); the first when it ended."""
        assert self.call is not None, "step() before reset()"
        self.turn += 1
        actions = [action, *action.alternatives]
        messages, finishes, counts = [], [], []
        calls_format = self.format.tool_format
        for a in actions:
            text = self.forced + a.text  # a forced call's opening is the env's, the rest the policy's
            content, calls, finish = chat_result(text, self.client_stops, self.tools, a.finish_reason, calls_format)
            messages.append(bodies.chat_message(content, calls))
            finishes.append(finish)
            # the model's calls, which the program runs: counted as ToolEnv counts them (malformed ones stay content)
            parsed = calls_format.parse(text, {t["function"]["name"]: t for t in self.tools}) if self.tools else []
            malformed = sum(isinstance(c, ParseError) for c in parsed)
            counts.append({"tool_calls": len(calls), "format_errors": malformed})
        self.call.reply(self._completion(messages, finishes, actions))
        self.answered = self.call
        # what a later prompt extends, token for token: the prompt + the ids of the answer it goes on with
        contexts = [(self.prompt + list(a.token_ids), a.finish_reason == "eos") for a in actions]
        answers = [_key(ChatMessage.model_validate(m)) for m in messages]
        self.turns.append(_Turn(self.sent, self.sent_tools, self.unforced, self.images, answers, contexts))
        self.call, self.choice = None, 0
        request, attached = [m.model_dump(exclude_none=True) for m in self.request_messages], self.attached
        event = await self._wait(render=self.turn < self.max_turns)
        self.answers.append(messages[self.choice])
        self.steps.append(EpisodeStep(request, messages[self.choice], attached))
        info = counts[self.choice] | ({"choice": self.choice} if len(actions) > 1 else {})
        unseen, self.unseen = float(self.unseen), False  # its connection closed before the answer reached it
        if unseen:
            info["unseen"] = True
        if isinstance(event, _Exit):
            reward, end = await asyncio.to_thread(self._end, event)  # a reward may run tests: off the loop
            return StepResult(None, reward, True, info | end)
        if isinstance(event, Call):  # the turn budget is spent: the episode ends as ToolEnv's does, reward 0
            event.reply(APIError(400, f"this episode's turn budget (max_turns={self.max_turns}) is spent"))
            return StepResult(None, 0.0, True, info | {"termination": Termination.MAX_TURNS})
        metrics = {f"gateway/{kind}_steps": float(self.attached == kind) for kind in ATTACHED}
        return StepResult(event, None, False, info | {"metrics": metrics | {"gateway/unseen_steps": unseen}})

    async def close(self) -> None:
        """End the episode however it ended: its routes answer 404, a request still waiting is answered with
        an error, and the program (with every process of its session) is killed."""
        if self.mailbox is not None:
            self.gateway.close(self.mailbox)
            self.mailbox.closed = True  # on this loop: a request delivered from now on is answered at once
            while not self.mailbox.inbox.empty():
                if isinstance(event := self.mailbox.inbox.get_nowait(), Call):
                    event.reply(self.mailbox.ended())
            if self.call is not None:
                self.call.reply(self.mailbox.ended())
        if self.proc is not None:  # its own session: what it started goes too, even after it exited itself
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                await asyncio.wait_for(self.proc.wait(), 5)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.workdir is not None:  # after the program is gone: nothing writes into it any more
            await asyncio.to_thread(shutil.rmtree, self.workdir, True)
            self.workdir = None

    # --- the program ---------------------------------------------------------------------------------
    async def _start(self, task: dict[str, Any], whole: dict[str, Any]) -> None:
        """Start the program given `task` (the fields it may see); `prepare` gets the `whole` task."""
        payload = json.dumps(task)
        if callable(self.program):
            self._start_function(json.loads(payload))
            return
        env = program_env(self.pass_env) | self.extra_env
        cwd = self.cwd
        if self.scratch:  # the episode's own directory: what the harness writes (files, its config) stays there
            self.workdir = cwd = tempfile.mkdtemp(prefix="agent-r1-episode-")
            env["HOME"] = cwd
            if self.prepare is not None:
                await asyncio.to_thread(self.prepare, whole, cwd)
        env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"] = self.base_url, self.api_key
        # Anthropic's SDK appends /v1/messages to its base URL itself
        env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_API_KEY"] = self.base_url.removesuffix("/v1"), self.api_key
        env["AGENT_R1_EPISODE"], env["AGENT_R1_REWARD_URL"] = self.mailbox.id, self.gateway.reward_url(self.mailbox)
        no_proxy = env.get("NO_PROXY") or env.get("no_proxy")  # an HTTP proxy must not swallow 127.0.0.1
        env["NO_PROXY"] = env["no_proxy"] = ",".join(filter(None, [no_proxy, "127.0.0.1", "localhost"]))
        if len(payload) <= TASK_ENV_MAX:
            env["AGENT_R1_TASK"] = payload
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *[_fill(arg, task) for arg in self.program], stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd,
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            raise ProgramError(f"cannot start the agent program {shlex.join(self.program)!r}: {exc}") from None
        readers = [
            asyncio.create_task(_drain(self.proc.stdout, self._stdout, STDOUT_KEPT)),
            asyncio.create_task(_drain(self.proc.stderr, self._stderr, STDERR_KEPT)),
        ]
        self._tasks = [*readers, asyncio.create_task(self._feed(payload)), asyncio.create_task(self._watch(readers))]

    def _start_function(self, task: dict[str, Any]) -> None:
        fn, mailbox, base_url, key = self.program, self.mailbox, self.base_url, self.api_key

        def run() -> None:
            try:
                result = _Exit(0, value=fn(task, base_url, key))
            except SystemExit as exc:
                result = _Exit(exc.code if isinstance(exc.code, int) else int(exc.code is not None))
            except BaseException as exc:  # the program's own exception is its episode's error, never the trainer's
                result = _Exit(1, error="".join(traceback.format_exception(exc)))
            mailbox.put(result)

        threading.Thread(target=run, daemon=True, name=f"agent-r1-program-{mailbox.id[:8]}").start()

    async def _feed(self, payload: str) -> None:
        """The task as one JSON line on stdin; a program that does not read it is fine."""
        stdin = self.proc.stdin
        with contextlib.suppress(OSError):  # a broken pipe: it exited or closed its stdin
            stdin.write(payload.encode() + b"\n")
            await stdin.drain()
        with contextlib.suppress(OSError):
            stdin.close()

    async def _watch(self, readers: list[asyncio.Task]) -> None:
        code = await self.proc.wait()
        await asyncio.wait(readers, timeout=1.0)  # what it wrote last (a child that keeps the pipe is not waited for)
        self.mailbox.put(_Exit(code))

    async def _wait(self, render: bool) -> Observation | Call | _Exit:
        """The program's next request (rendered into an observation when `render`) or its exit, within
        `timeout_s`. A request that cannot be rendered is answered with a 400 naming why, and waited past."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                event = await asyncio.wait_for(self.mailbox.inbox.get(), deadline - loop.time())
            except TimeoutError:
                raise ProgramError(
                    f"the agent program neither called the model nor exited within timeout_s={self.timeout_s:g}s"
                    + self._tail(self._written())
                ) from None
            if isinstance(event, Unseen):
                self.unseen = self.unseen or event.call is self.answered
                continue
            if isinstance(event, _Exit) or not render:
                return event
            try:
                return await off_loop(self._observe, event)  # other episodes go on meanwhile
            except APIError as exc:
                event.reply(exc)

    # --- requests and answers ------------------------------------------------------------------------
    def _observe(self, call: Call) -> Observation:
        """The prompt ids of a chat request: the previous context extended by the new messages' delta when the
        request repeats the history, else the whole conversation rendered afresh."""
        body = call.body
        check_unicode(body)
        tools = tool_schemas(body.tools) if body.tools and body.tool_choice != "none" else []
        # checks every message: a 400 names the first bad one
        messages = template_messages(body.messages, tools, self.format)
        fmt = self.format.with_tools(tools) if self.format.native_tools and tools else self.format
        pictures = sum(len(image_parts(m)) for m in messages)
        if pictures and getattr(self.format, "encoder", None) is None:
            raise APIError(400, f"the request has {pictures} image(s) but the policy reads text only", param="messages")
        forced = forced_call(body.tool_choice, tools, self.format.tool_format)
        special = tuple(self.format.tokenizer.all_special_tokens)
        grammar = answer_grammar(body, tools, self.format.tool_format, special)  # what the API promises
        tools_key = json.dumps(tools, sort_keys=True)
        sent = [_key(m) for m in body.messages]
        turn, new, choice = self._attach(body.messages, sent, tools_key, bool(tools))
        try:
            if new is not None:  # it extends an earlier answer: that context + the new messages' delta
                delta = template_messages(new, [], self.format)
                context, after_eos = turn.contexts[choice]
                ids = context + fmt.continuation(delta, after_eos=after_eos)
                images = turn.images + fmt.images(delta)
            elif turn is not None and sent == turn.sent:  # the same request again (a retry): the same prompt
                ids, images = list(turn.prompt), list(turn.images)
            else:
                ids, images = fmt.initial(messages), fmt.images(messages)
        except ValueError as exc:  # images the template and the messages disagree on, an unreadable image
            raise APIError(400, str(exc), param="messages") from None
        self.unforced = ids
        if forced:  # the answer's forced opening ends the prompt: the policy samples on from it
            ids = ids + self.format.tokenizer.encode(forced, add_special_tokens=False)
        self.attached = "merged" if new is not None else "branched" if turn is not None else "fresh"
        self.call, self.prompt, self.images = call, ids, images
        self.choice = choice if turn is not None and turn is self.turns[-1] else 0
        self.forced, self.samples, self.grammar = forced, body.n, grammar
        self.sent, self.sent_tools = sent, tools_key
        self.request_messages, self.tools = body.messages, tools
        self.client_stops = body.stops + tuple(self.format.stop)  # where the answer's visible text ends
        one_call = tools and not body.parallel_tool_calls  # stop after the first call, as ToolEnv does
        self.stop = (self.format.tool_format.stop if one_call else ()) + body.stops + tuple(self.format.stop)
        return Observation(token_ids=list(ids), images=list(images))

    def _count_tokens(self, body: Any) -> int:
        """The length of `body`'s prompt rendered afresh (Anthropic's count_tokens); the episode is untouched."""
        tools = tool_schemas(body.tools) if body.tools and body.tool_choice != "none" else []
        fmt = self.format.with_tools(tools) if self.format.native_tools and tools else self.format
        return len(fmt.initial(template_messages(body.messages, tools, self.format)))

    def _attach(
        self, messages: list[ChatMessage], sent: list[str], tools_key: str, tools: bool
    ) -> tuple[_Turn | None, list[ChatMessage] | None, int]:
        """Where a request attaches in the episode's tree: (the earlier turn, the messages after its answer,
        which answer) when it repeats the longest earlier request + answer it can (any earlier one, not only
        the last: a harness's main line goes on after a sub-agent's requests); else (the earlier turn it
        shares the most leading messages with, None, 0), a branch (a retry, a compaction, an edit); else
        (None, None, 0), a fresh start (a sub-agent's own first request)."""
        merges = []
        for turn in self.turns:
            n = len(turn.sent)
            if turn.tools == tools_key and len(messages) > n and sent[:n] == turn.sent and sent[n] in turn.answers:
                new = messages[n + 1 :]
                # with tools, a system message joins the tools system prompt at the top: not an append
                if not (tools and any(m.role in ("system", "developer") for m in new)):
                    merges.append((n, turn, new, turn.answers.index(sent[n])))
        if merges:  # the longest (the latest of equals): its sampled ids stay as sampled
            _, turn, new, choice = max(reversed(merges), key=lambda m: m[0])
            return turn, new, choice
        shared = [(_common(sent, t.sent), i) for i, t in enumerate(self.turns) if t.tools == tools_key]
        k, i = max(shared, default=(0, -1))
        return (self.turns[i], None, 0) if k else (None, None, 0)

    def _completion(self, messages: list[dict], finishes: list[str], actions: list[Action]) -> dict[str, Any]:
        body = self.call.body
        choices = []
        for k, (message, finish, action) in enumerate(zip(messages, finishes, actions, strict=True)):
            tokenizer = self.format.tokenizer
            logprobs = bodies.token_logprobs(tokenizer, action.token_ids, action.logprobs) if body.logprobs else None
            choices.append(bodies.chat_choice(k, message, finish, logprobs))
        completion_tokens = sum(len(a.token_ids) for a in actions)
        return bodies.chat_completion(bodies.head("chat", body.model), choices, len(self.prompt), completion_tokens)

    # --- the end -------------------------------------------------------------------------------------
    def _end(self, end: _Exit) -> tuple[float | None, dict[str, Any]]:
        """The program exited after an answer: the outcome reward and the step's info, or an error if it failed."""
        if end.code != 0 or end.error:
            raise ProgramError(self._failure(end))
        stdout = self._stdout.decode(errors="replace")
        output = ProgramOutput(end.code, stdout, end.value, self.mailbox.reward, self.workdir)
        info: dict[str, Any] = {"termination": Termination.ANSWERED}
        if self.reward_fn is None:  # the reward the program posted, if any (none: 0)
            return output.reward, info
        last = [*self.steps[-1].messages, self.answers[-1]]
        result = self.reward_fn(self.task, Episode(last, list(self.answers), list(self.steps)), output)
        value, parts, scores = (*result, {})[:3] if isinstance(result, tuple) else (result, {}, {})
        info |= {"reward_parts": dict(parts)}
        if scores:  # the reward function scored steps of their own: process rewards, checked like a posted one
            info["step_rewards"] = {}
            for k, r in dict(scores).items():
                # the last step carries the outcome itself
                if not (isinstance(k, int) and 0 <= k < len(self.steps) - 1 and abs(float(r)) <= self.max_reward):
                    raise ValueError(
                        f"the reward function scored step {k!r} with {r!r}: give an earlier step's index, in "
                        f"[0, {len(self.steps) - 1}), "
                        f"and a reward in [-{self.max_reward:g}, {self.max_reward:g}] (task.max_reward)"
                    )
                info["step_rewards"][k] = float(r)
        return float(value), info

    def _failure(self, end: _Exit) -> str:
        if end.error:
            return "the agent program raised" + self._tail(end.error.strip())
        if end.code < 0:
            what = f"the agent program was killed by signal {-end.code}"
        elif end.code:
            what = f"the agent program exited with code {end.code}"
        else:
            what = "the agent program exited without calling the model"
        return what + self._tail(self._written())

    def _written(self) -> str:
        """What the command wrote, for its error: its stderr, or its stdout when that is empty."""
        return self._stderr.decode(errors="replace").strip() or self._stdout.decode(errors="replace")

    @staticmethod
    def _tail(text: str) -> str:
        """The end of what the program wrote (stderr, a traceback), which the episode's error shows."""
        text = text.strip()
        if not text:
            return ""
        return f"; it wrote: {'...' if len(text) > ERROR_TAIL else ''}{text[-ERROR_TAIL:]}"


async def _drain(stream: asyncio.StreamReader, into: bytearray, keep: int) -> None:
    """Read a pipe to its end (a full pipe would block the program), keeping its last `keep` bytes."""
    while chunk := await stream.read(65536):
        into += chunk
        if len(into) > keep:
            del into[: len(into) - keep]


@dataclass
class _Turn:
    """One answered request, a node of the episode's tree: what it sent, and each answer's token context."""

    sent: list[str]  # the request's messages, by `_key`
    tools: str  # its tools, as JSON
    prompt: list[int]  # its prompt ids (before a forced call's opening)
    images: list[Any]  # the prompt's images
    answers: list[str]  # each answer the gateway gave, by `_key`
    contexts: list[tuple[list[int], bool]]  # per answer: prompt + its sampled ids, whether it ended at eos


def _common(a: list[str], b: list[str]) -> int:
    """How many leading messages two requests share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _fill(arg: str, task: dict[str, Any]) -> str:
    """A command argument with each `{field}` naming a field the program is given replaced by its value (a
    harness takes its task as an argument: `claude -p {question}`); other braces stay as they are."""
    return re.sub(r"\{(\w+)\}", lambda m: str(task[m[1]]) if m[1] in task else m[0], arg)


def _key(m: ChatMessage) -> str:
    """What of a message reaches the prompt, to tell a repeated history from a rewritten one: the role, the
    content (an assistant's text with its ends stripped) and the tool calls with their arguments as parsed
    JSON (whitespace and key order do not count). Call ids never reach the prompt."""
    content: Any = m.content
    if m.role == "assistant" and isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")
    if m.role == "assistant":
        content = (content or "").strip()
    calls = [[c.function.name, _json(c.function.arguments)] for c in m.tool_calls or []]
    return json.dumps([m.role, content or "", calls], sort_keys=True)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def program_env(pass_env: Sequence[str] = ()) -> dict[str, str]:
    """The trainer's environment as an agent program gets it: `INHERITED_ENV`, the locale's `LC_*` and the
    names in `pass_env`. Everything else (API tokens, cloud credentials, the trainer's own settings) stays
    out of reach of a program that may run model-written code."""
    keep = set(INHERITED_ENV) | set(pass_env)
    return {k: v for k, v in os.environ.items() if k in keep or k.startswith("LC_")}


@dataclass(frozen=True)
class ProgramEnvFactory:
    """`make_env()` for the rollout loop: a fresh `ProgramEnv` per episode. It pickles (Ray workers, other
    processes) when the program and the reward are a command line, import paths or module-level functions;
    each process starts its own gateway server on first use."""

    tokenizer: Any  # the policy's tokenizer (or a vision-language model's processor)
    command: str | tuple[str, ...] | None = None  # the program as a command line, or its arguments
    function: str | Callable[..., Any] | None = None  # or fn(task, base_url, api_key), or its import path
    reward: str | RewardFn | None = None  # reward(task, episode, output), or its import path; None: posted
    timeout_s: float = 60.0
    max_turns: int = 8
    chat: bool | None = None  # the chat template (None: when the tokenizer has one) or plain text
    tool_format: str = "auto"  # the tool-call family (agent_r1.env.tool_formats): auto = the template's
    env: tuple[tuple[str, str], ...] = ()  # more environment variables for a command
    cwd: str | None = None
    pass_env: tuple[str, ...] = ()  # the trainer's variables a command may inherit beyond INHERITED_ENV
    max_reward: float = 100.0  # a posted reward outside [-max_reward, max_reward] is refused
    task_fields: tuple[str, ...] = ("question",)  # the task's fields the program is given
    scratch: bool = False  # each episode's command runs in a fresh directory (cwd and HOME) of its own
    prepare: str | Callable[[dict[str, Any], str], None] | None = None  # prepare(task, directory), or its path

    def __post_init__(self) -> None:
        if (self.command is None) == (self.function is None):
            raise ValueError("give the agent program as exactly one of command or function")
        if isinstance(self.command, list):
            object.__setattr__(self, "command", tuple(self.command))
        for what, path in (("function", self.function), ("reward", self.reward), ("prepare", self.prepare)):
            if isinstance(path, str):
                import_path(path, what)  # a typo fails here, not in the first episode

    def __call__(self) -> ProgramEnv:
        fn = import_path(self.function, "function") if isinstance(self.function, str) else self.function
        reward = import_path(self.reward, "reward") if isinstance(self.reward, str) else self.reward
        prepare = import_path(self.prepare, "prepare") if isinstance(self.prepare, str) else self.prepare
        fmt = prompt_format_for(self.tokenizer, self.chat, self.tool_format)
        return ProgramEnv(
            self.command if self.command is not None else fn, fmt,
            reward, timeout_s=self.timeout_s, max_turns=self.max_turns, env=dict(self.env), cwd=self.cwd,
            pass_env=self.pass_env, max_reward=self.max_reward, task_fields=self.task_fields, scratch=self.scratch,
            prepare=prepare,
        )  # fmt: skip


__all__ = [
    "Episode",
    "EpisodeStep",
    "ProgramEnv",
    "ProgramEnvFactory",
    "ProgramError",
    "ProgramOutput",
    "import_path",
    "program_env",
]
